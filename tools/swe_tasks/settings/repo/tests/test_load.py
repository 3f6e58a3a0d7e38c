from settings import load_settings


def test_missing_file(tmp_path):
    assert load_settings(tmp_path / "nope.json") == {}


def test_valid_file(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('{"debug": true}')
    assert load_settings(path) == {"debug": True}
