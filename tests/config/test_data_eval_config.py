"""The ``data`` section and the sampled-evaluation fields of ``train``: defaults, checks, round trip."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from sao_megatron.config import ConfigError, load_config, save_config
from sao_megatron.config.schema import DataConfig, TrainConfig


def test_defaults_keep_the_bundled_prompts_and_greedy_pass1_only():
    cfg = load_config()
    assert cfg.data == DataConfig() and cfg.data.train == ""
    assert (cfg.train.eval_temperature, cfg.train.eval_samples, cfg.train.eval_sample_temperature) == (
        0.0,
        0,
        1.0,
    )


def test_paper_configs_report_mean_accuracy_over_16_samples():
    for name in ("qwen3_30b_a3b_math", "moe_750b_a40b", "deepseek_v3_671b_math", "kimi_k2_1t_math", "glm4_5_355b_math"):
        t = load_config(f"configs/{name}.yaml").train
        assert (t.eval_samples, t.eval_sample_temperature) == (16, 1.0)


def test_every_new_field_has_a_docstring():
    import inspect

    from sao_megatron.config import schema

    source = inspect.getsource(schema)
    for cls, names in (
        (DataConfig, [f.name for f in dataclasses.fields(DataConfig)]),
        (
            TrainConfig,
            [
                "eval_temperature",
                "eval_samples",
                "eval_sample_temperature",
                "eval_max_turns",
                "value_pretrain_stop_on",
                "value_pretrain_stop_window",
            ],
        ),
    ):
        body = inspect.getsource(cls)
        for name in names:
            after = body.split(f"\n    {name}:", 1)[1].split("\n", 2)[1]
            assert after.strip().startswith('"""'), f"{cls.__name__}.{name} has no docstring"
    assert "class DataConfig" in source


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.eval_samples=-1"], "train.eval_samples=-1 must be >= 0"),
        (["train.eval_samples=2.5"], "train.eval_samples: expected an integer"),
        (["train.eval_max_turns=-1"], "train.eval_max_turns=-1 must be >= 0"),
        (["train.value_pretrain_stop_on=ev"], "train.value_pretrain_stop_on"),
        (
            ["train.value_pretrain_steps=5", "train.value_pretrain_stop_window=6"],
            "train.value_pretrain_stop_window=6 with train.value_pretrain_steps=5: the stop averages the "
            "last window steps, so use 1 to 5",
        ),
        (["train.value_pretrain_stop_window=0"], "train.value_pretrain_stop_window=0"),
        (["data.train=a.jsonl"], "data.train is set but data.eval is empty; set data.eval=FILE"),
        (["data.train=a.jsonl", "data.eval=b.jsonl", "data.answer_field="], "data.answer_field is empty"),
        (["data.meta_fields=solution"], "data.meta_fields: expected a list"),
        (["data.prompt_fields=x"], "unknown config key 'data.prompt_fields'; did you mean 'prompt_field'?"),
    ],
)
def test_bad_data_and_eval_settings_fail_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_data_section_round_trips_through_the_run_config(tmp_path):
    overrides = [
        "data.train=t.jsonl",
        "data.eval=e.jsonl",
        "data.prompt_format=messages",
        "data.prompt_field=msgs",
        "data.meta_fields=[level, solution]",
        "data.seed=3",
        "train.eval_samples=16",
    ]
    cfg = load_config(None, overrides)
    again = load_config(save_config(cfg, tmp_path))
    assert again.data == cfg.data and again.train == cfg.train
    assert typing.get_args(typing.get_type_hints(DataConfig)["prompt_format"]) == ("text", "messages")
