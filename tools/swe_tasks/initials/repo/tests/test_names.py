from initials.names import initials, surname


def test_initials():
    assert initials("ada lovelace") == "AL"


def test_surname():
    assert surname("Ada King Lovelace") == "Lovelace"
