"""Registry: built-in names, user classes from dotted paths, and helpful errors."""

from __future__ import annotations

import textwrap

import pytest

from sao_megatron.envs import Env, RewardResult, Sample, StepResult, Task, list_envs, make_env, make_task
from sao_megatron.envs.registry import register_env, resolve_env

USER_MODULE = textwrap.dedent(
    """
    from sao_megatron.envs import Env, RewardResult, Sample, StepResult, Task

    class EchoTask(Task):
        def get(self, split, index):
            return Sample(f"echo:{split}:{index}", f"say {index}", str(index))

    class EchoEnv(Env):
        task_class = EchoTask

        def __init__(self, bonus=0.0):
            self.bonus = bonus

        def reset(self, sample):
            self.sample, self.said = sample, None
            return sample.question

        def step(self, action):
            self.said = action
            return StepResult(None, True)

        def reward(self):
            ok = self.said == self.sample.answer
            return RewardResult(float(ok) + self.bonus, ok)

    NOT_AN_ENV = 3
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "my_sao_envs.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_sao_envs"


def test_builtin_names_are_listed_and_build() -> None:
    assert {"arith_tool", "math_python", "writing_shift"} <= set(list_envs())
    for name in ("arith_tool", "math_python", "writing_shift"):
        env = make_env(name)
        assert isinstance(env, Env)
        assert isinstance(make_task(name), Task)
    assert make_env("arith_tool") is not make_env("arith_tool")  # one instance per episode


def test_dotted_path_loads_user_env_with_kwargs(user_module: str) -> None:
    env = make_env(f"{user_module}:EchoEnv", bonus=0.5)
    sample = make_task(f"{user_module}:EchoEnv").get("train", 7)
    assert env.reset(sample) == "say 7"
    assert env.step("7") == StepResult(None, True)
    assert env.reward() == RewardResult(1.5, True)


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("no_such_env", "not a registered name nor a dotted path"),
        ("no_such_package_xyz.module:Env", "importing 'no_such_package_xyz.module' failed"),
        ("json:NoSuchClass", "has no attribute 'NoSuchClass'"),
        ("json:JSONDecoder", "is not an Env subclass"),
        (":EchoEnv", "not a registered name nor a dotted path"),
    ],
)
def test_bad_paths_raise_value_error_with_fix(path: str, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        make_env(path)
    message = str(info.value)
    assert repr(path) in message and fragment in message
    assert "package.module:ClassName" in message and "arith_tool" in message


def test_not_an_env_in_user_module(user_module: str) -> None:
    with pytest.raises(ValueError, match="is not an Env subclass"):
        resolve_env(f"{user_module}:NOT_AN_ENV")


def test_register_env_decorator(user_module: str) -> None:
    import importlib

    module = importlib.import_module(user_module)
    register_env("echo_for_test")(module.EchoEnv)
    try:
        assert isinstance(make_env("echo_for_test"), module.EchoEnv)
        with pytest.raises(ValueError, match="already registered"):

            @register_env("echo_for_test")
            class Other(module.EchoEnv):
                pass

        with pytest.raises(TypeError):
            register_env("bad")(int)  # type: ignore[arg-type]
    finally:
        from sao_megatron.envs import registry

        registry._REGISTRY.pop("echo_for_test", None)


def test_env_without_task_class_is_reported() -> None:
    class Bare(Env):
        def reset(self, sample: Sample) -> str:
            return ""

        def step(self, action: str) -> StepResult:
            return StepResult(None, True)

        def reward(self) -> RewardResult:
            return RewardResult(0.0, None)

    register_env("bare_for_test")(Bare)
    try:
        with pytest.raises(ValueError, match="task_class"):
            make_task("bare_for_test")
        with pytest.raises(NotImplementedError):
            Bare().demonstration(Sample("x", "q", "a"))
    finally:
        from sao_megatron.envs import registry

        registry._REGISTRY.pop("bare_for_test", None)
