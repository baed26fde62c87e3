"""Swap a model instance's BERT submodules for fused equivalents, and back.

`swap(model, ops)` walks `model.named_modules()`, replaces each matching instance by a fused module
that holds the *same* submodules and Parameter objects (so optimizers, state_dict keys, checkpoints
and `save_pretrained` are unaffected), logs one line per replacement and returns a `SwapReport`;
`report.revert()` puts the original module objects back exactly. Classes are never patched.

Op families, applied coarse to fine (a module inside one already replaced is left to its parent);
each family declares its entry (`SWAP`) in its own module, listed in `bertaccel.ops.registry`:
    linear (opt-in)      nn.Linear                   -> GemmLinear (own TMA + wgmma GEMM, Hopper); applied
                         first: the coarser families keep the swapped layers and run their matmul on it
    ffn (opt-in)         BertLayer's feed-forward    -> the same layer with a FusedFeedForward child (GEMM +
                         bias + GELU, GEMM, residual LN; dGELU in the dgrad GEMM; own GEMM, Hopper); claims
                         the layer's intermediate and output, not its attention
    embeddings           BertEmbeddings              -> FusedBertEmbeddings (lookups+sum+LN+dropout)
    softmax              BertSelfAttention (eager)   -> FusedBertSelfAttention (QKV in one GEMM, scale+mask+softmax)
    qkv                  BertSelfAttention (SDPA)    -> FusedQKVSelfAttention (QKV projections in one GEMM)
    residual_layer_norm  BertSelfOutput / BertOutput -> FusedBertOutput (bias+dropout+residual+LN)
    bias_gelu            BertIntermediate            -> FusedBertIntermediate (bias+GELU)
    layer_norm           nn.LayerNorm                -> FusedLayerNorm
    rms_norm             nn.RMSNorm                  -> FusedRMSNorm
(`python -c "from bertaccel.ops import registry; print(registry.describe())"` prints the live list.)
The softmax family takes only attention modules that run eager attention: SDPA and flash attention
never materialise the softmax (they are faster than any separate softmax kernel), so with them the
modules stay as they are and the report says why.

Targeting by module name (torchtitan style): `only` / `exclude` take fnmatch patterns over module
names (e.g. `bert.encoder.layer.1[01].*`) and restrict what the families may claim.
"""

from __future__ import annotations

import fnmatch
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from bertaccel.errors import ConfigError
from bertaccel.ops.eligibility import kernels_loaded
from bertaccel.ops import build
from bertaccel.ops import registry

log = logging.getLogger(__name__)

FAMILIES = registry.swap_entries()
ORDER = list(FAMILIES)  # every family, opt-in ones included
DEFAULT = registry.default_families()  # what `ops: [all]` selects


@dataclass
class Replacement:
    name: str
    family: str
    original: nn.Module
    replacement: nn.Module


@dataclass
class SwapReport:
    model: nn.Module
    replaced: list[Replacement] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)  # (name, family, reason)
    kernels: bool = False

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.replaced:
            out[r.family] = out.get(r.family, 0) + 1
        return out

    def summary(self) -> str:
        counts = ", ".join(f"{k}: {v}" for k, v in self.counts().items()) or "nothing"
        where = "CUDA kernels" if self.kernels else "PyTorch fallback (kernels unavailable)"
        return f"kernel swap: replaced {len(self.replaced)} modules ({counts}); running on {where}"

    def revert(self) -> None:
        """Put every original module back (innermost last-replaced first)."""
        for r in reversed(self.replaced):
            _set_submodule(self.model, r.name, r.original)
            log.info("kernel swap: restored %s", r.name)
        self.replaced.clear()


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def _share_hooks(original: nn.Module, new: nn.Module) -> None:
    """The replacement fires the original's module hooks (HF's output recorders for
    `output_attentions`, profiler regions), registered before or after the swap: they share the
    hook dictionaries."""
    for attr in _HOOK_DICTS:
        if hasattr(original, attr):
            setattr(new, attr, getattr(original, attr))


def _install_hf_output_recorders(model: nn.Module) -> None:
    """HF installs its output-recording hooks (attentions, hidden states) on first forward, by
    module class; install them now, on the original modules, so the replacements share them."""
    try:
        from transformers import PreTrainedModel
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:
        return
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            maybe_install_capturing_hooks(m)
            return


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


def _targeted(name: str, only: Sequence[str], exclude: Sequence[str]) -> bool:
    if only and not any(fnmatch.fnmatchcase(name, p) for p in only):
        return False
    return not any(fnmatch.fnmatchcase(name, p) for p in exclude)


def swap(model: nn.Module, ops: Sequence[str], only: Sequence[str] = (), exclude: Sequence[str] = ()) -> SwapReport:
    """Replace the submodules of `model` covered by the op families `ops` (see module docstring);
    with `only` / `exclude` (fnmatch patterns over module names), just the modules they select."""
    unknown = [o for o in ops if o not in FAMILIES]
    if unknown:
        raise ConfigError(f"unknown kernel-swap ops {unknown}; known: {ORDER}.")
    dupes = sorted({o for o in ops if list(ops).count(o) > 1})
    if dupes:
        raise ConfigError(f"kernel-swap ops {dupes} are listed twice: every module they cover would be claimed twice.")
    report = SwapReport(model, kernels=kernels_loaded())
    if not report.kernels and ops:
        warnings.warn(
            f"kernel swap: the CUDA kernels are unavailable ({build.reason()}); the swapped modules "
            "run PyTorch's ops.", stacklevel=2,
        )
    _install_hf_output_recorders(model)
    claimed: dict[str, str] = {}  # replaced sub-trees (or, for families with `claims`, those children)
    replaced_by: dict[str, str] = {}
    for family in [f for f in ORDER if f in ops]:
        entry = FAMILIES[family]
        for name, module in list(model.named_modules()):
            reason = entry.skip_reason(module)
            if reason == "" or not _targeted(name, only, exclude):
                continue
            if name in replaced_by:
                raise ConfigError(f"module {name} is claimed twice: by {replaced_by[name]} and {family}.")
            if any(name == c or name.startswith(c + ".") for c in claimed):
                continue  # part of a module a coarser family replaced already
            if reason is not None:
                report.skipped.append((name, family, reason))
                log.warning("kernel swap: %s stays PyTorch (%s)", name, reason)
                continue
            new = entry.from_module(module)
            _share_hooks(module, new)
            _set_submodule(model, name, new)
            replaced_by[name] = family
            for part in entry.claims or ("",):
                claimed[f"{name}.{part}" if part else name] = family
            report.replaced.append(Replacement(name, family, module, new))
            log.info("kernel swap: %s %s -> %s", name, type(module).__name__, type(new).__name__)
    log.info(report.summary())
    return report
