"""``cluster.container``, ``cluster.env`` and ``cluster.checkpoint_gb_per_s``: one-line errors."""

import pytest

from sao_megatron.config import ConfigError, load_config


def test_defaults_run_on_the_host_with_no_extra_environment():
    c = load_config("configs/tiny_cpu.yaml").cluster
    assert c.container.runtime == "none" and c.container.image == "" and c.container.mounts == []
    assert c.env == {} and c.checkpoint_gb_per_s == 2.0


def test_a_container_and_an_environment_load():
    c = load_config(
        "configs/tiny_cpu.yaml",
        [
            "cluster.container={runtime: apptainer, image: /images/sao.sif, mounts: [/scratch:/scratch:ro]}",
            "cluster.env={NCCL_IB_HCA: mlx5, NCCL_IB_TIMEOUT: 22}",
            "cluster.container.workdir=/work",
        ],
    ).cluster
    assert c.container.runtime == "apptainer" and c.container.mounts == ["/scratch:/scratch:ro"]
    assert c.container.workdir == "/work" and c.env == {"NCCL_IB_HCA": "mlx5", "NCCL_IB_TIMEOUT": 22}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["cluster.container.runtime=docker"],
            "cluster.container.runtime: 'docker' is not one of 'none', 'pyxis', 'apptainer'",
        ),
        (["cluster.container.runtime=pyxis"], "cluster.container.runtime=pyxis needs cluster.container.image"),
        (["cluster.container.image=x.sif"], "cluster.container.runtime=none; set runtime to pyxis or apptainer"),
        (
            ["cluster.container={runtime: pyxis, image: i, mounts: ['/a,/b']}"],
            "cluster.container.mounts[0]='/a,/b': write one SRC[:DST[:FLAGS]] per list entry",
        ),
        (["cluster.container={runtime: pyxis, image: i, mounts: [':/b']}"], "cluster.container.mounts[0]=':/b'"),
        (
            ["cluster.container.runtime=pyxis", "cluster.container.image=i", "cluster.container.mounts=/a"],
            "cluster.container.mounts: expected a list",
        ),
        (["cluster.env={1NCCL: x}"], "cluster.env: '1NCCL' is not a valid environment variable name"),
        (["cluster.env={NCCL-IB: x}"], "cluster.env: 'NCCL-IB' is not a valid environment variable name"),
        (["cluster.env={SAO_ROOT: /x}"], "cluster.env.SAO_ROOT: SAO_* variables configure the launch script"),
        (["cluster.env={NCCL_DEBUG: [a]}"], "cluster.env.NCCL_DEBUG=['a']: values must be strings or numbers"),
        (["cluster.env={NCCL_DEBUG: true}"], "values must be strings or numbers; quote it"),
        (["cluster.env=mlx5"], "cluster.env: expected a mapping"),
        (["rollout.engine_env={OMP-THREADS: 1}"], "rollout.engine_env: 'OMP-THREADS' is not a valid environment"),
        (["rollout.engine_env={OMP_NUM_THREADS: [1]}"], "rollout.engine_env.OMP_NUM_THREADS=[1]: values must be"),
        (["cluster.checkpoint_gb_per_s=0"], "cluster.checkpoint_gb_per_s=0.0 must be > 0"),
        (["cluster.container.runtim=pyxis"], "unknown config key 'cluster.container.runtim'; did you mean 'runtime'?"),
    ],
)
def test_launch_settings_fail_in_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny_cpu.yaml", overrides)
    assert message in str(err.value), str(err.value)
