"""Muon and NorMuon for 2-D weight matrices, AdamW for every other parameter, in one optimizer.

Muon (Jordan et al., 2024) replaces a weight matrix's momentum update by its orthogonal polar factor
(U V^T of the update's SVD), approximated by a few odd polynomial iterations X <- a X + b (X X^T) X
+ c (X X^T)^2 X:

- `newton-schulz`: Muon's quintic, the same (a, b, c) = (3.4445, -4.7750, 2.0315) every step. It
  does not converge to U V^T (singular values end up between ~0.2 and ~1.2), which trains as well;
- `polar-express`: the per-step coefficients of Amsel et al., "The Polar Express" (2025), for
  singular values in [1e-3, 1], with their 1.01 safety factor; converges to U V^T;
- `svd`: the exact polar factor (slow; for tests and small matrices).

NorMuon (Li et al., 2025) then divides each row (output neuron) of the orthogonalised update by the
root of a running mean of its squared entries and rescales the matrix back to the Frobenius norm it
had, so that neurons with persistently large updates take smaller steps.

The update is scaled by sqrt(max(1, rows / cols)) (Muon's rule) and applied with decoupled weight
decay. Parameter groups with `muon: True` take this path; the others are plain AdamW. Everything is
tensor arithmetic without host reads (learning rates may be 0-d device tensors), so the step can be
captured in a CUDA graph. One optimizer object, so Lightning's automatic optimization, LR schedules,
gradient clipping and checkpoints work unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import torch

NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)
_POLAR_EXPRESS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
_SAFETY = 1.01
# the safety factor widens every polynomial's interval but the last (which has converged already)
POLAR_EXPRESS = tuple((a / _SAFETY, b / _SAFETY**3, c / _SAFETY**5) for a, b, c in _POLAR_EXPRESS[:-1]) + _POLAR_EXPRESS[-1:]
ORTHOGONALIZERS = ("newton-schulz", "polar-express", "svd")


def orthogonalize(g: torch.Tensor, steps: int = 5, method: str = "newton-schulz") -> torch.Tensor:
    """An approximation of the orthogonal polar factor U V^T of the matrix `g`, or of each matrix of a
    stack [n, rows, cols] (see the module docstring), in g's dtype. The iterations run in bf16 on a GPU
    (as Muon does) and fp32 on CPU; a stack runs as batched matmuls (one kernel per product for the
    whole stack, which is how the optimizer orthogonalises every matrix of one shape at once)."""
    if g.ndim not in (2, 3):
        raise ValueError(f"orthogonalize takes a matrix or a stack of matrices, got shape {tuple(g.shape)}")
    if method == "svd":
        u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
        return (u @ vh).to(g.dtype)
    if method not in ORTHOGONALIZERS:
        raise ValueError(f"unknown orthogonalizer {method!r}; one of {ORTHOGONALIZERS}")
    x = g.to(torch.bfloat16 if g.is_cuda else torch.float32)
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    norm = x.norm(dim=(-2, -1), keepdim=True)  # each matrix's own Frobenius norm
    if method == "polar-express":
        x = x / (norm * _SAFETY + 1e-7)
        coefficients = [POLAR_EXPRESS[min(i, len(POLAR_EXPRESS) - 1)] for i in range(steps)]
    else:
        x = x / (norm + 1e-7)
        coefficients = [NEWTON_SCHULZ] * steps
    for a, b, c in coefficients:
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return (x.mT if tall else x).to(g.dtype)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (or NorMuon) on the parameter groups marked `muon: True` (2-D matrices), AdamW on the rest.

    Args:
        params: Parameter groups; a group with `"muon": True` must hold only 2-D tensors.
        lr: AdamW learning rate (groups may set their own `lr`; Muon groups usually use ~0.02).
        betas, eps: AdamW's.
        weight_decay: Decoupled weight decay (both kinds of group), multiplied by the group's lr.
        momentum: Muon's momentum (with Nesterov when `nesterov`).
        ns_steps: Polynomial iterations of the orthogonalisation.
        orthogonalizer: "newton-schulz", "polar-express" or "svd".
        normuon: Per-row second-moment normalisation of the orthogonalised update (NorMuon).
        beta2: NorMuon's second-moment decay.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        orthogonalizer: Literal["newton-schulz", "polar-express", "svd"] = "newton-schulz",
        normuon: bool = False,
        beta2: float = 0.95,
    ) -> None:
        if orthogonalizer not in ORTHOGONALIZERS:
            raise ValueError(f"unknown orthogonalizer {orthogonalizer!r}; one of {ORTHOGONALIZERS}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, momentum=momentum,
                        nesterov=nesterov, ns_steps=ns_steps, orthogonalizer=orthogonalizer, normuon=normuon,
                        beta2=beta2, muon=False)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon parameter groups take 2-D weight matrices only.")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_group(group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:
        """Every matrix of the group at once: momentum with foreach ops, then the matrices of each
        shape stacked and orthogonalised by batched matmuls (BERT-base: two stacks, 48 of 768 x 768
        and 24 of 768 x 3072 / 3072 x 768 after the transpose), not one small matmul chain each."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        lr, wd, beta = group["lr"], group["weight_decay"], group["momentum"]
        grads = [p.grad.float() for p in params]
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
                if group["normuon"]:
                    state["second_moment"] = torch.zeros(p.size(0), 1, dtype=torch.float32, device=p.device)
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        torch._foreach_lerp_(bufs, grads, 1 - beta)
        updates = torch._foreach_lerp(grads, bufs, beta) if group["nesterov"] else bufs
        by_shape: dict[tuple, list[int]] = {}  # (rows, cols, device, dtype) -> positions in params
        for i, p in enumerate(params):
            by_shape.setdefault((*p.shape, str(p.device), p.dtype), []).append(i)
        for index in by_shape.values():
            ps = [params[i] for i in index]
            rows, cols = ps[0].shape
            o = orthogonalize(torch.stack([updates[i] for i in index]), group["ns_steps"], group["orthogonalizer"]).float()
            if group["normuon"]:
                norm = o.norm(dim=(-2, -1), keepdim=True)
                seconds = [self.state[p]["second_moment"] for p in ps]
                second = torch.stack(seconds).lerp_((o * o).mean(dim=-1, keepdim=True), 1 - group["beta2"])
                torch._foreach_copy_(seconds, list(second.unbind(0)))
                o = o / (second.sqrt() + 1e-10)
                o = o * (norm / (o.norm(dim=(-2, -1), keepdim=True) + 1e-10))  # back to the update's Frobenius norm
            o = o * (math.sqrt(max(1.0, rows / cols)) * lr)
            torch._foreach_mul_(ps, 1 - lr * wd)  # lr: a number or a 0-d tensor
            torch._foreach_sub_(ps, list(o.to(ps[0].dtype).unbind(0)))

    def _adamw_group(self, group: dict[str, Any]) -> None:
        """AdamW (decoupled weight decay, bias-corrected moments) over the group with foreach ops."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        grads = [p.grad for p in params]
        steps = [self.state[p]["step"] for p in params]
        m = [self.state[p]["exp_avg"] for p in params]
        v = [self.state[p]["exp_avg_sq"] for p in params]
        torch._foreach_add_(steps, 1)
        torch._foreach_mul_(params, 1 - lr * wd)
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        bias1 = torch._foreach_pow(beta1, steps)  # beta1 ** step, then 1 - that
        torch._foreach_neg_(bias1)
        torch._foreach_add_(bias1, 1)
        bias2 = torch._foreach_pow(beta2, steps)
        torch._foreach_neg_(bias2)
        torch._foreach_add_(bias2, 1)
        denom = torch._foreach_div(v, bias2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        step_size = torch._foreach_reciprocal(bias1)  # lr / bias1
        torch._foreach_mul_(step_size, lr)
        update = torch._foreach_div(m, denom)
        torch._foreach_mul_(update, step_size)
        torch._foreach_sub_(params, update)

