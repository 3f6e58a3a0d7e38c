"""Software-engineering tasks in the SWE-bench instance schema: loading, repositories, test rewards.

* :mod:`~sao_megatron.envs.swe.tasks`: :class:`SWETask` records read from JSONL/Parquet,
  :func:`materialise` (a task's snapshot as a git repository whose first commit is
  ``base_commit``) and :func:`unified_diff` (git-style patches between two snapshots).
* :mod:`~sao_megatron.envs.swe.reward`: :func:`compute_reward`, the hidden-test reward of an
  edited workspace (apply ``test_patch``, run ``FAIL_TO_PASS`` + ``PASS_TO_PASS``).
* :mod:`~sao_megatron.envs.swe.editor`: :class:`FileEditor`, OpenHands' ``str_replace_editor``
  (view / create / str_replace / insert / undo_edit) confined to a workspace.
* :mod:`~sao_megatron.envs.swe.env`: :class:`~sao_megatron.envs.swe.env.SWEEnv`, the ``swe``
  environment (``execute_bash`` in a sandboxed shell, the editor, ``finish``; hidden-test reward),
  imported on use through the registry (it pulls in the shell sandbox).
* :mod:`~sao_megatron.envs.swe.importer`: ``sao swe import``, real SWE-bench records (a git mirror
  and ``base_commit``, no ``files``) as task rows, checked and optionally verified in the env.

The bundled task set (``data/swe/tasks.jsonl``) is written by ``tools/make_swe_tasks.py``.
"""

from sao_megatron.envs.swe.editor import FileEditor
from sao_megatron.envs.swe.reward import SWEReward, compute_reward, episode_patch, local_runner
from sao_megatron.envs.swe.tasks import DATA_PATH, SWETask, load_tasks, materialise, unified_diff

__all__ = [
    "DATA_PATH",
    "FileEditor",
    "SWEReward",
    "SWETask",
    "compute_reward",
    "episode_patch",
    "load_tasks",
    "local_runner",
    "materialise",
    "unified_diff",
]
