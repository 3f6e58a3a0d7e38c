"""``sao plan``: parameters and memory per GPU of every role, before any GPU is touched.

Parameters per rank are counted two independent ways:

- **meta build** (exact, the default; :mod:`~sao_megatron.plan.meta`): the role's real Megatron
  model is built on torch's ``meta`` device, one rank per pipeline stage, in a child process
  (``python -m sao_megatron.plan``) inside a fake one-process world of the role's size.
- **analytic** (:mod:`~sao_megatron.plan.params`, :func:`stage_parameters`): every parameter of a
  stage's rank with its Megatron name and local shape, from the model shape and layout alone.
  Tests check it name by name against the meta build; ``sao plan --analytic`` uses it without
  importing Megatron.

:mod:`~sao_megatron.plan.memory` turns them into memory per GPU (the model is described there),
:mod:`~sao_megatron.plan.fit` into node groups and fit checks (:func:`make_plan`), and
:mod:`~sao_megatron.plan.render` into the tables and JSON ``sao plan`` prints.
"""

from sao_megatron.plan.fit import Plan, PlanError, make_plan, role_nodes, uses_critic
from sao_megatron.plan.memory import (
    LOGIT_COPIES,
    RESERVED_GIB,
    EngineMemory,
    GiB,
    RoleMemory,
    RouteMemory,
    activation_bytes_per_layer,
    engine_memory,
    role_memory,
    route_memory,
)
from sao_megatron.plan.meta import MetaJob, meta_parameters
from sao_megatron.plan.params import StageParams, analytic_parameters, stage_parameters
from sao_megatron.plan.render import render, to_json

__all__ = [
    "LOGIT_COPIES",
    "RESERVED_GIB",
    "EngineMemory",
    "GiB",
    "MetaJob",
    "Plan",
    "PlanError",
    "RoleMemory",
    "RouteMemory",
    "StageParams",
    "activation_bytes_per_layer",
    "analytic_parameters",
    "engine_memory",
    "make_plan",
    "meta_parameters",
    "render",
    "role_memory",
    "route_memory",
    "role_nodes",
    "stage_parameters",
    "to_json",
    "uses_critic",
]
