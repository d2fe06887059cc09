# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""MuonClip's QK-clip under ZeRO-1/2/3 (``"qk_clip_threshold": tau`` in the Muon block): the clip itself.

Source: Kimi K2 (arXiv 2507.20534), 2.1: after each step, every head whose largest pre-softmax logit ``S_h`` exceeded
``tau`` gets its query and key weights scaled by ``gamma_h = tau / S_h`` (rules: ``HeadSpan``, sources in the user
guide). Layers described by ``AttentionHeads`` (``mark_attention`` for a model of one's own; ``hf_attention`` for
Hugging Face layers) report per-head maxima (``record_max_logits``); ``QKClip`` MAX-all-reduces them once per step and
scales each rank's fp32 partition pieces after the inner step; no state. Design: docs/design.md.
"""

import math
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from deepspeed import comm as dist
from deepspeed.runtime.zero.muon.config import QK_CLIP_KEY as THRESHOLD_KEY
from deepspeed.utils import logger

WHERE = f"optimizer.params.{THRESHOLD_KEY}"
"""The key as messages name it."""
MARK_ATTR = "muon_qk_clip"
"""Module attribute: the layer's ``AttentionHeads`` (``mark_attention``)."""
SQRT, FULL, LAYER_MIN = "sqrt", "full", "layer_min"


@dataclass(frozen=True)
class HeadSpan:
    """Heads of ``head_dim`` elements along ``dim`` (0: rows, 1: columns) of ``param`` (2-D weight, bias or norm
    weight) from index ``start``; scaled by ``sqrt(gamma_h)`` (``SQRT``), ``gamma_h`` (``FULL``) or, as one block,
    the layer's smallest ``gamma`` (``LAYER_MIN``)."""
    param: torch.nn.Parameter
    dim: int
    start: int
    head_dim: int
    rule: str

    def scale_line(self, gamma: torch.Tensor, length: int) -> torch.Tensor:
        """fp32 scale per index along ``dim`` (``length``; 1 outside the heads) for ``gamma`` (fp32, ``(heads,)``)."""
        blocks = {SQRT: gamma.sqrt, FULL: lambda: gamma, LAYER_MIN: lambda: gamma.min().reshape(1)}[self.rule]()
        line = torch.ones(length, dtype=torch.float32, device=gamma.device)
        line[self.start:self.start + blocks.numel() * self.head_dim] = blocks.repeat_interleave(self.head_dim)
        return line


@dataclass(frozen=True)
class AttentionHeads:
    """One attention layer for QK-clip: its query heads and the spans of its parameters the clip scales."""
    num_heads: int
    spans: Tuple[HeadSpan, ...]


def qk_spans(q_weight, k_weight, num_heads, num_kv_heads, head_dim, q_bias=None, k_bias=None, dim=0, starts=(0, 0)):
    """Spans of a layer's query and key projections: ``SQRT`` on both for MHA; for GQA ``FULL`` on the query and
    nothing on the shared key. ``dim`` and ``starts`` (query's, key's) as in ``HeadSpan``, for the weights."""
    rule = SQRT if num_kv_heads == num_heads else FULL
    scaled = [(q_weight, dim, starts[0]), (q_bias, 0, starts[0])]
    if rule == SQRT:
        scaled += [(k_weight, dim, starts[1]), (k_bias, 0, starts[1])]
    return tuple(HeadSpan(p, d, start, head_dim, rule) for p, d, start in scaled if p is not None)


def mark_attention(module: torch.nn.Module, heads: AttentionHeads) -> None:
    """Clip ``module`` as ``heads`` says; its forward reports its maxima (``record_max_logits``), else steps raise."""
    setattr(module, MARK_ATTR, heads)


_RECORDING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # module -> (QKClip, layer index)


def record_max_logits(module: torch.nn.Module, maxima: torch.Tensor) -> None:
    """Fold ``module``'s per-head maximum logits of a micro-step (``(num_heads,)``) into the step's, if clipped."""
    clip, index = _RECORDING.get(module, (lambda: None, 0))
    clip = clip()
    if clip is not None and module.training:
        part = clip.maxima[clip.offsets[index]:clip.offsets[index + 1]]
        if maxima.shape != part.shape:
            raise ValueError(f"{WHERE}: {type(module).__name__} reported maxima of shape {tuple(maxima.shape)}, "
                             f"not one per head ({part.numel()}).")
        torch.maximum(part, maxima.detach().to(part.device, torch.float32), out=part)


def is_recorded(module: torch.nn.Module) -> bool:
    """Whether a live ``QKClip`` clips ``module`` (its logits are to be recorded)."""
    return module in _RECORDING


def check_threshold(value) -> Optional[float]:
    """``qk_clip_threshold`` as a float, None where off; ValueError naming it for another value."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{WHERE}: {value!r}; the largest attention logit QK-clip lets a head keep, a finite number "
                         "> 0 (Kimi K2 used 100), or null (the default) for no clipping.")
    return None if value is None else float(value)


def check_runs_here(where: Optional[str], autotp_size: int) -> None:
    """Refuse QK-clip where no owner rank runs the update (``where_no_owner_runs``'s phrase) or AutoTP splits heads.

    Raises:
        ValueError: naming ``qk_clip_threshold`` and the configuration.
    """
    if where is not None:
        raise ValueError(f"{WHERE}: QK-clip runs at ZeRO stages 1 to 3 (it scales the fp32 partitions in the "
                         f"ZeRO step), not with {where}; use one of those stages, or remove {THRESHOLD_KEY}.")
    if autotp_size > 1:
        raise ValueError(f"{WHERE}: QK-clip needs each attention layer's heads on every rank; with "
                         f"tensor_parallel.autotp_size {autotp_size} they are split.")


class QKClip:
    """The clip of one engine's attention layers.

    Args:
        threshold: ``tau``.
        layers: ``(name, module, AttentionHeads)`` of each layer clipped (``hf_attention.find_attention``).
        process_group / device: the data-parallel group the maxima are reduced over / where they live.
        steps_per_print: rank 0 logs the heads clipped every that many steps (0: never).
        partitions: partitions the stage steps per optimizer step; the maxima start over once each was applied.

    Attributes:
        maxima: fp32 ``(heads,)`` (layer after layer, ``offsets``): this step's largest logit per head.
        last_max: the maxima of the last step taken; ``heads_clipped``, ``steps``: since rank 0's last log.

    A step the loss scale skips runs no inner step, so its maxima (same weights) carry into the next step.
    """

    def __init__(self, threshold, layers, process_group, device, steps_per_print=0, partitions=1):
        self.threshold = threshold
        self.names, self.modules, self.layers = (list(column) for column in zip(*layers))
        self.offsets = [sum(heads.num_heads for heads in self.layers[:i]) for i in range(len(self.layers) + 1)]
        self.maxima = torch.full((self.offsets[-1], ), float("-inf"), dtype=torch.float32, device=device)
        self.spans: Dict[int, List[Tuple[HeadSpan, int]]] = {}
        for index, heads in enumerate(self.layers):
            for span in heads.spans:
                self.spans.setdefault(id(span.param), []).append((span, index))
        self.process_group, self.steps_per_print, self.partitions = process_group, steps_per_print, partitions
        self.gamma: Optional[torch.Tensor] = None  # the step's, once reduced
        self.last_max: Optional[torch.Tensor] = None
        self.heads_clipped = self.steps = self._applied = 0
        self._held: Dict[int, list] = {}
        self._lines: Dict[Tuple[int, torch.device], torch.Tensor] = {}
        for index, module in enumerate(self.modules):
            _RECORDING[module] = (weakref.ref(self), index)

    def _reduce(self) -> torch.Tensor:
        """Every head's fp32 ``gamma`` from one MAX all-reduce (one host copy). A head no rank recorded (eval mode,
        skipped) or whose logit overflowed is not clipped; rank 0 warns."""
        dist.all_reduce(self.maxima, op=dist.ReduceOp.MAX, group=self.process_group)
        tops = self.maxima.tolist()
        unseen = [
            n for i, n in enumerate(self.names)
            if not all(map(math.isfinite, tops[self.offsets[i]:self.offsets[i + 1]]))
        ]
        if unseen and dist.get_rank() == 0:
            logger.warning(
                f"QK-clip: not clipped in this step, no finite logit recorded: {', '.join(unseen)} (in eval "
                "mode, skipped, or attention outside eager_attention_forward and sdpa)")
        tau = torch.tensor(self.threshold, dtype=torch.float32, device=self.maxima.device)
        over = torch.isfinite(self.maxima) & (self.maxima > tau)
        self.last_max, self.heads_clipped = self.maxima.clone(), self.heads_clipped + int(over.sum())
        self._clipped = [
            any(math.isfinite(t) and t > self.threshold for t in tops[self.offsets[i]:self.offsets[i + 1]])
            for i in range(len(self.names))
        ]
        return torch.where(over, tau / self.maxima, torch.ones_like(self.maxima))

    @torch.no_grad()
    def apply(self, partition) -> None:
        """Scale this rank's pieces of the clipped heads in ``partition``'s fp32 ``flat`` after the inner step. The
        step's first call (same order on every rank) reduces the maxima; its last starts the next step's."""
        if self.gamma is None:
            self.gamma, self._lines = self._reduce(), {}
        if partition.key not in self._held:
            self._held[partition.key] = [piece for piece in partition.held_pieces() if id(piece[0]) in self.spans]
        for param, start, offset, numel in self._held[partition.key]:
            scale = self._piece_scale(param, start, numel, partition.flat.device)
            if scale is not None:
                partition.flat.narrow(0, offset, numel).mul_(scale)
        self._applied += 1
        if self._applied == self.partitions:
            self._end_step()

    def _line(self, param, device) -> Optional[torch.Tensor]:
        """The product of ``param``'s spans' scale lines (None where all are 1), cached for the step."""
        cache_key = (id(param), device)
        if cache_key not in self._lines:
            shape = tuple(getattr(param, "ds_shape", param.shape))
            line = dim = None
            for span, index in self.spans[id(param)]:
                if not self._clipped[index]:
                    continue
                assert dim in (None, span.dim), "a parameter's heads run along one dimension"
                gamma = self.gamma[self.offsets[index]:self.offsets[index + 1]]
                part = span.scale_line(gamma, shape[span.dim]).to(device)
                line = part if line is None else line * part
                dim = span.dim
            self._lines[cache_key] = None if line is None else (line, dim, shape)
        return self._lines[cache_key]

    def _piece_scale(self, param, start: int, numel: int, device) -> Optional[torch.Tensor]:
        """fp32 scale of elements ``[start, start + numel)`` of flattened ``param``, from the rows they cover."""
        if numel == 0:
            return None
        entry = self._line(param, device)
        if entry is None:
            return None
        line, dim, shape = entry
        if len(shape) == 1:
            return line[start:start + numel]
        width = math.prod(shape[1:])
        first, last = start // width, (start + numel - 1) // width + 1
        if dim == 0:
            rows = line[first:last, None].expand(-1, width)
        else:
            rows = line[None, :].expand(last - first, -1)
        skip = start - first * width
        return rows.reshape(-1)[skip:skip + numel]

    def _end_step(self) -> None:
        """Start the next step's maxima; rank 0 logs the heads clipped every ``steps_per_print`` steps."""
        self.maxima.fill_(float("-inf"))
        self.steps, self.gamma, self._applied = self.steps + 1, None, 0
        if self.steps and self.steps_per_print and self.steps % self.steps_per_print == 0:
            if dist.get_rank() == 0:
                logger.info(f"QK-clip: {self.heads_clipped} head-steps clipped over the last {self.steps} steps "
                            f"({self.offsets[-1]} heads; {THRESHOLD_KEY} {self.threshold:g}; largest logit of "
                            f"the last step {float(self.last_max.max()):.4g})")
            self.heads_clipped = self.steps = 0
