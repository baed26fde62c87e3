"""Swap a model instance's BERT submodules for fused equivalents, and back.

`swap(model, ops)` walks `model.named_modules()`, replaces each matching instance by a fused module
that holds the *same* submodules and Parameter objects (so optimizers, state_dict keys, checkpoints
and `save_pretrained` are unaffected), logs one line per replacement and returns a `SwapReport`;
`report.revert()` puts the original module objects back exactly. Classes are never patched.

Op families, applied coarse to fine (a module inside one already replaced is left to its parent):
    embeddings           BertEmbeddings              -> FusedBertEmbeddings (lookups+sum+LN+dropout)
    softmax              BertSelfAttention (eager)   -> FusedBertSelfAttention (scale+mask+softmax)
    residual_layer_norm  BertSelfOutput / BertOutput -> FusedBertOutput (bias+dropout+residual+LN)
    bias_gelu            BertIntermediate            -> FusedBertIntermediate (bias+GELU)
    layer_norm           nn.LayerNorm                -> FusedLayerNorm
    rms_norm             nn.RMSNorm                  -> FusedRMSNorm
The softmax family takes only attention modules that run eager attention: SDPA and flash attention
never materialise the softmax (they are faster than any separate softmax kernel), so with them the
modules stay as they are and the report says why.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn

from bertaccel.errors import ConfigError
from bertaccel.ops.eligibility import kernels_loaded
from bertaccel.ops import build
from bertaccel.ops.embeddings import FusedBertEmbeddings
from bertaccel.ops.gelu import FusedBertIntermediate, activation_kind
from bertaccel.ops.layer_norm import FusedLayerNorm
from bertaccel.ops.residual_layer_norm import FusedBertOutput
from bertaccel.ops.rms_norm import FusedRMSNorm
from bertaccel.ops.softmax import FusedBertSelfAttention

log = logging.getLogger(__name__)


def _is_bert_output(m: nn.Module) -> bool:
    return type(m).__name__ in ("BertSelfOutput", "BertOutput") and all(
        hasattr(m, a) for a in ("dense", "dropout", "LayerNorm")
    ) and isinstance(m.LayerNorm, nn.LayerNorm)


def _is_bert_embeddings(m: nn.Module) -> bool:
    return type(m).__name__ == "BertEmbeddings" and all(
        isinstance(getattr(m, a, None), nn.Embedding) for a in ("word_embeddings", "position_embeddings", "token_type_embeddings")
    ) and isinstance(getattr(m, "LayerNorm", None), nn.LayerNorm)


def _attention_skip_reason(m: nn.Module) -> str | None:
    if type(m).__name__ != "BertSelfAttention" or not all(hasattr(m, a) for a in ("query", "key", "value", "scaling")):
        return ""
    impl = getattr(m.config, "_attn_implementation", None) or "eager"
    return None if impl == "eager" else f"runs {impl} attention, which never materialises the softmax"


def _is_bert_intermediate(m: nn.Module) -> bool:
    return type(m).__name__ == "BertIntermediate" and hasattr(m, "dense") and hasattr(m, "intermediate_act_fn")


# family -> (matches(module) -> reason-to-skip or None for "take it", build(module) -> replacement)
FAMILIES: dict[str, tuple[Callable[[nn.Module], str | None], Callable[[nn.Module], nn.Module]]] = {
    "embeddings": (
        lambda m: None if _is_bert_embeddings(m) else "",
        FusedBertEmbeddings,
    ),
    "softmax": (_attention_skip_reason, FusedBertSelfAttention),
    "residual_layer_norm": (
        lambda m: None if _is_bert_output(m) else "",
        FusedBertOutput,
    ),
    "bias_gelu": (
        lambda m: ("" if not _is_bert_intermediate(m)
                   else None if activation_kind(m.intermediate_act_fn) is not None
                   else f"activation {type(m.intermediate_act_fn).__name__} is not a GELU"),
        FusedBertIntermediate,
    ),
    "layer_norm": (
        lambda m: ("" if type(m) is not nn.LayerNorm
                   else None if len(m.normalized_shape) == 1 and m.elementwise_affine
                   else "not an affine LayerNorm over the last dimension"),
        FusedLayerNorm.from_module,
    ),
    "rms_norm": (
        lambda m: ("" if type(m) is not nn.RMSNorm
                   else None if len(m.normalized_shape) == 1 and m.weight is not None
                   else "not an RMSNorm with a weight over the last dimension"),
        FusedRMSNorm.from_module,
    ),
}
ORDER = list(FAMILIES)


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


def swap(model: nn.Module, ops: Sequence[str]) -> SwapReport:
    """Replace the submodules of `model` covered by the op families `ops` (see module docstring)."""
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
    claimed: dict[str, str] = {}
    for family in [f for f in ORDER if f in ops]:
        matches, make = FAMILIES[family]
        for name, module in list(model.named_modules()):
            reason = matches(module)
            if reason == "":
                continue
            owner = next((c for c in claimed if name == c or name.startswith(c + ".")), None)
            if owner is not None:
                if name == owner:
                    raise ConfigError(f"module {name} is claimed twice: by {claimed[owner]} and {family}.")
                continue  # part of a module a coarser family replaced already
            if reason is not None:
                report.skipped.append((name, family, reason))
                log.warning("kernel swap: %s stays PyTorch (%s)", name, reason)
                continue
            new = make(module)
            _share_hooks(module, new)
            _set_submodule(model, name, new)
            claimed[name] = family
            report.replaced.append(Replacement(name, family, module, new))
            log.info("kernel swap: %s %s -> %s", name, type(module).__name__, type(new).__name__)
    log.info(report.summary())
    return report
