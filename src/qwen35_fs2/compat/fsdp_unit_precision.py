"""Workaround: an FSDP2 unit that keeps fp32 under fairseq2's mixed
precision.

fairseq2 0.8.1 wraps every FSDP2 unit of a model through one wrapper
(``fairseq2.nn.fsdp.to_fsdp2``), which applies the same
:class:`~torch.distributed.fsdp.MixedPrecisionPolicy` to all of them: with
``mixed_precision.mode: static`` every parameter is gathered in bf16. The
wrapper takes no policy of its own, and wrapping a unit with
:func:`~torch.distributed.fsdp.fully_shard` directly would skip what the
wrapper does besides (materializing meta parameters, broadcasting the state
of rank 0). So the Gated DeltaNet decay units are wrapped by fairseq2's
wrapper, and then :func:`keep_fsdp_unit_in_fp32` replaces their policy
before their first forward pass, when FSDP2 reads it.

This relies on private attributes of FSDP2 in PyTorch 2.9 (the unit's
``FSDPState._mp_policy``, its ``FSDPParamGroup.mp_policy`` and each
``FSDPParam.mp_policy``, read at lazy initialization);
``tests/integration/sharding/test_fsdp2.py`` fails if they change. Revisit
when fairseq2's wrapper accepts a policy per unit.
"""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.nn import Module


def keep_fsdp_unit_in_fp32(module: Module) -> None:
    """Makes the FSDP2 unit ``module`` (just wrapped, not yet run) gather its
    parameters and reduce their gradients in their own dtype (fp32).

    :raises TypeError: ``module`` is not an FSDP2 unit.
    :raises RuntimeError: the unit already ran, or FSDP2's internals are not
        those this workaround knows.
    """
    if not isinstance(module, FSDPModule):
        raise TypeError(
            f"`module` must be an FSDP2 unit (`FSDPModule`), but is a `{type(module).__name__}` instead."
        )

    state = module._get_fsdp_state()

    param_group = state._fsdp_param_group

    if param_group is None:
        raise RuntimeError(
            "The FSDP2 unit has no parameter group. Only units with parameters can be kept in fp32."
        )

    if not hasattr(state, "_mp_policy") or not hasattr(param_group, "mp_policy"):
        raise RuntimeError(
            "FSDP2's unit state has no `_mp_policy`/`mp_policy` attribute in this PyTorch version, which `keep_fsdp_unit_in_fp32` relies on. Update the workaround in `qwen35_fs2.compat.fsdp_unit_precision`."
        )

    # FSDP2 sets `orig_dtype` when it reads the policy, at the first forward.
    if any(hasattr(fsdp_param, "orig_dtype") for fsdp_param in param_group.fsdp_params):
        raise RuntimeError(
            "The FSDP2 unit already ran with its mixed precision policy. Keep it in fp32 right after wrapping it."
        )

    # No casts at all: parameters, gradients and the reduction stay in the
    # dtype of the sharded parameters.
    policy = MixedPrecisionPolicy()

    state._mp_policy = policy

    param_group.mp_policy = policy

    for fsdp_param in param_group.fsdp_params:
        fsdp_param.mp_policy = policy


def fsdp_unit_mixed_precision(module: Module) -> MixedPrecisionPolicy:
    """Returns the mixed precision policy that fairseq2's wrapper gave the
    FSDP2 unit ``module``, for units wrapped without it (the routed experts
    under expert parallelism, sharded over a mesh of their own).

    :raises TypeError: ``module`` is not an FSDP2 unit.
    :raises RuntimeError: FSDP2's internals are not those this workaround
        knows.
    """
    if not isinstance(module, FSDPModule):
        raise TypeError(
            f"`module` must be an FSDP2 unit (`FSDPModule`), but is a `{type(module).__name__}` instead."
        )

    policy = getattr(module._get_fsdp_state(), "_mp_policy", None)

    if not isinstance(policy, MixedPrecisionPolicy):
        raise RuntimeError(
            "FSDP2's unit state has no `_mp_policy` attribute in this PyTorch version, which `fsdp_unit_mixed_precision` relies on. Update the workaround in `qwen35_fs2.compat.fsdp_unit_precision`."
        )

    return policy
