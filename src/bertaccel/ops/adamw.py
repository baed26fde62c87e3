"""AdamW for fp32 master weights with bf16 copies (modules/weight_copies.py) in one pass
(csrc/adamw.cu): reads the copies' bf16 gradients, updates the masters and AdamW's moments, and
writes the refreshed bf16 copies. Not a kernel-swap family: the graphed training step calls it
(modules/train_step.py) in place of widening the gradients, PyTorch's fused AdamW and the refresh.
`adamw_` is the same kernel for parameters without copies (their own fp32 gradients, no copy written):
the graphed step updates those with it too (BERTACCEL_ADAMW_ALL=0: PyTorch's fused AdamW instead).

The CPU kernel is the reference (the same fp32 arithmetic as PyTorch's fused AdamW), so the schema,
opcheck and the step logic are tested without a GPU.
"""

from __future__ import annotations

import torch

from bertaccel.ops.registration import NS, lib

CUDA_SOURCES = ["adamw.cu"]

lib.define(
    "adamw_bf16_copies_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs,"
    " Tensor[] steps, Tensor(d!)[] copies, Tensor lr, float beta1, float beta2, float weight_decay, float eps) -> ()"
)


lib.define(
    "adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, Tensor[] steps,"
    " Tensor lr, float beta1, float beta2, float weight_decay, float eps) -> ()"
)


def _adamw_reference(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps, copies=None):
    lr = float(lr)
    with torch.no_grad():
        for i, (p, g, m, v, t) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
            g = g.float()
            step = float(t)
            p.mul_(1 - lr * weight_decay)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - beta1**step))
            if copies is not None:
                copies[i].copy_(p)


@torch.library.impl(lib, "adamw_bf16_copies_", "CPU")
def _adamw_cpu(params, grads, exp_avgs, exp_avg_sqs, steps, copies, lr, beta1, beta2, weight_decay, eps):
    _adamw_reference(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps, copies)


@torch.library.impl(lib, "adamw_", "CPU")
def _adamw_plain_cpu(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps):
    _adamw_reference(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps)


@torch.library.register_fake(f"{NS}::adamw_")
def _adamw_plain_fake(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps):
    return None


@torch.library.register_fake(f"{NS}::adamw_bf16_copies_")
def _adamw_fake(params, grads, exp_avgs, exp_avg_sqs, steps, copies, lr, beta1, beta2, weight_decay, eps):
    return None


def adamw_bf16_copies_(params, grads, exp_avgs, exp_avg_sqs, steps, copies, lr, beta1, beta2, weight_decay, eps):
    """One AdamW step on `params` (fp32 masters) from `grads` (their copies' bf16 gradients), writing
    `copies` (bf16). `steps` are the parameters' step counts, already incremented for this step."""
    torch.ops.bertaccel.adamw_bf16_copies_(params, grads, exp_avgs, exp_avg_sqs, steps, copies, lr, beta1, beta2,
                                           weight_decay, eps)
