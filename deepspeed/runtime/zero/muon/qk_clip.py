# Copyright (c) 2026 The zero3muon authors
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""MuonClip's QK-clip under ZeRO-1/2/3 (``"qk_clip_threshold": tau`` in the Muon block).

Source: Kimi K2 (arXiv 2507.20534), 2.1. After each step, every head whose largest pre-softmax logit ``S_h`` of the
step exceeded ``tau`` gets its query and key weights scaled by ``gamma_h = tau / S_h`` (rules: ``HeadSpan``; the
user guide gives their sources). Logits recorded through transformers' attention functions or reported
(``record_max_logits``), one MAX all-reduce per step, each rank's pieces of the fp32 partitions scaled right after
the inner optimizer step (``QKClip.apply``); no state. Design: docs/design.md.
"""

import copy
import importlib
import math
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from deepspeed import comm as dist
from deepspeed.runtime.zero.muon.config import QK_CLIP_KEY as THRESHOLD_KEY
from deepspeed.utils import logger

_WHERE = f"optimizer.params.{THRESHOLD_KEY}"
MARK_ATTR = "muon_qk_clip"
"""Module attribute: the layer's ``AttentionHeads`` (``mark_attention``)."""
SQRT, FULL, LAYER_MIN = "sqrt", "full", "layer_min"
RECORDED_IMPLEMENTATIONS = ("eager", "sdpa")
_QUERY_CHUNK_ELEMENTS = 1 << 24  # logits computed at once by max_logits, to bound its transient memory


@dataclass(frozen=True)
class HeadSpan:
    """Heads of ``head_dim`` elements along dimension ``dim`` (0: rows, 1: columns) of ``param`` (a 2-D weight, a
    bias or norm weight), head 0 at index ``start``; scaled by ``sqrt(gamma_h)`` (``SQRT``), ``gamma_h``
    (``FULL``) or, one block, the layer's smallest ``gamma`` (``LAYER_MIN``)."""
    param: torch.nn.Parameter
    dim: int
    start: int
    head_dim: int
    rule: str

    def scale_line(self, gamma: torch.Tensor, length: int) -> torch.Tensor:
        """The fp32 scale of each of ``length`` indices along ``dim`` (1 outside the heads), for the layer's
        ``gamma`` (fp32, ``(heads,)``)."""
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
    """The spans of a layer's query and key projections under the rules above (``SQRT`` on both for multi-head
    attention, ``FULL`` on the query and nothing on a shared key for grouped-query attention). ``dim`` and
    ``starts`` (query's, key's): as in ``HeadSpan``, for the weights; biases run along their only dimension."""
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
            raise ValueError(f"{_WHERE}: {type(module).__name__} reported maxima of shape {tuple(maxima.shape)}, "
                             f"not one per head ({part.numel()}).")
        torch.maximum(part, maxima.detach().to(part.device, torch.float32), out=part)


def max_logits(query: torch.Tensor, key: torch.Tensor, attention_mask: Optional[torch.Tensor], scaling: float,
               is_causal: bool) -> torch.Tensor:
    """fp32 ``(heads,)``: per head the maximum of ``query @ key^T * scaling`` (``(batch, heads, q_len, d)`` by
    ``(batch, kv_heads, k_len, d)``, query head h on key head ``h // (heads / kv_heads)``) where ``attention_mask``
    (additive float or boolean, broadcastable to ``(batch, heads, q_len, k_len)``) lets through, or with None and
    ``is_causal``, keys up to ``i + k_len - q_len``; ``-inf`` for a head that sees nothing. In ``query``'s dtype,
    chunks of about 2^24 logits, no gradient."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = heads // kv_heads
    key_t = key.detach().transpose(2, 3)
    chunk = max(1, _QUERY_CHUNK_ELEMENTS // max(1, batch * heads * k_len))
    best = torch.full((heads, ), float("-inf"), dtype=torch.float32, device=query.device)
    with torch.no_grad():
        for lo in range(0, q_len, chunk):
            hi = min(q_len, lo + chunk)
            q = query.detach()[:, :, lo:hi].reshape(batch, kv_heads, group * (hi - lo), head_dim)
            if q.dtype == torch.float16:  # its logits overflow where fp32's and bf16's do not
                q, key_t = q.float(), key_t.float()
            logits = torch.matmul(q, key_t).reshape(batch, heads, hi - lo, k_len) * scaling
            if attention_mask is not None:
                mask = attention_mask[...,
                                      lo:hi, :k_len] if attention_mask.shape[-2] > 1 else attention_mask[..., :k_len]
                if mask.dtype == torch.bool:
                    logits = logits.masked_fill(~mask, float("-inf"))
                else:
                    logits = logits + mask
                    logits = logits.masked_fill(mask <= torch.finfo(mask.dtype).min / 2, float("-inf"))
            elif is_causal and q_len > 1:
                rows = torch.arange(lo, hi, device=query.device)[:, None] + (k_len - q_len)
                logits = logits.masked_fill(torch.arange(k_len, device=query.device)[None, :] > rows, float("-inf"))
            best = torch.maximum(best, logits.amax(dim=(0, 2, 3)).float())
    return best


def _recording(attention, sdpa: bool):
    """``attention`` (transformers' signature) wrapped to record the logits of the layers being clipped."""
    if getattr(attention, "_muon_qk_clip", False):
        return attention

    def recorded(module, query, key, value, attention_mask, *args, **kwargs):
        if module in _RECORDING and module.training and not hasattr(module, MARK_ATTR):
            changed = [k for k in ("position_bias", "softcap") if kwargs.get(k) is not None]
            if args or changed:
                raise ValueError(f"{_WHERE}: {type(module).__name__} passes {changed or 'positional arguments'} to "
                                 "its attention, which QK-clip's recorded logits do not include.")
            scaling = kwargs.get("scaling")
            if scaling is None:
                scaling = query.shape[-1]**-0.5
            # eager attends where its mask says, everywhere without one; sdpa is causal without a mask
            is_causal = kwargs.get("is_causal")
            is_causal = sdpa and (getattr(module, "is_causal", True) if is_causal is None else is_causal)
            record_max_logits(module, max_logits(query, key, attention_mask, scaling, is_causal))
        return attention(module, query, key, value, attention_mask, *args, **kwargs)

    recorded._muon_qk_clip, recorded.__wrapped__ = True, attention
    return recorded


def install_recorders(modules: Sequence[torch.nn.Module]) -> None:
    """Wrap (once; other modules' calls pass through) transformers' ``"sdpa"`` (``AttentionInterface.register``)
    and the ``eager_attention_forward`` of the modeling file of each of ``modules``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
    AttentionInterface.register("sdpa", _recording(ALL_ATTENTION_FUNCTIONS["sdpa"], sdpa=True))
    for module in modules:
        modeling = importlib.import_module(type(module).__module__)
        if hasattr(modeling, "eager_attention_forward"):
            modeling.eager_attention_forward = _recording(modeling.eager_attention_forward, sdpa=False)


def describe_attention(module: torch.nn.Module) -> Optional[AttentionHeads]:
    """The ``AttentionHeads`` of a Hugging Face self-attention layer with ``head_dim``: ``q_proj``/``k_proj``
    ``nn.Linear`` (Llama, Mistral, Qwen2/3, Qwen3-MoE and most decoders; ``q_norm`` where present), Phi-3's
    ``qkv_proj`` rows, GPT-2's ``Conv1D`` ``c_attn`` columns; None for any other layout."""
    from transformers.pytorch_utils import Conv1D
    head_dim, config = getattr(module, "head_dim", None), getattr(module, "config", None)
    if not isinstance(head_dim, int) or head_dim < 1 or getattr(module, "is_cross_attention", False):
        return None
    q, k, qkv, c_attn = (getattr(module, name, None) for name in ("q_proj", "k_proj", "qkv_proj", "c_attn"))
    q, k, qkv = (m if isinstance(m, torch.nn.Linear) else None for m in (q, k, qkv))
    if q is not None and k is not None:
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if not isinstance(heads, int) or heads % kv_heads or (q.out_features, k.out_features) != (heads * head_dim,
                                                                                                  kv_heads * head_dim):
            return None  # e.g. a gated query (Qwen3-Next) or heads the config does not give
        norm = getattr(module, "q_norm", None)
        if norm is None and getattr(module, "k_norm", None) is None:
            return AttentionHeads(heads, qk_spans(q.weight, k.weight, heads, kv_heads, head_dim, q.bias, k.bias))
        if norm is not None and _scales_with_weight(norm, head_dim):
            return AttentionHeads(heads, (HeadSpan(norm.weight, 0, 0, head_dim, LAYER_MIN), ))
    elif qkv is not None and config is not None:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if qkv.out_features == (heads + 2 * kv_heads) * head_dim:
            spans = qk_spans(qkv.weight, qkv.weight, heads, kv_heads, head_dim, qkv.bias, qkv.bias, 0,
                             (0, heads * head_dim))
            return AttentionHeads(heads, spans)
    elif isinstance(c_attn, Conv1D) and c_attn.nf == 3 * getattr(module, "num_heads", 0) * head_dim:
        heads, width = module.num_heads, module.num_heads * head_dim
        spans = qk_spans(c_attn.weight, c_attn.weight, heads, heads, head_dim, c_attn.bias, c_attn.bias, 1, (0, width))
        return AttentionHeads(heads, spans)
    return None


def _scales_with_weight(norm, size: int) -> bool:
    """Whether ``norm`` (one parameter, ``weight`` of ``size``) returns its normalized input times ``weight``
    (RMSNorm), so that scaling the weight scales its output; not ``x * (1 + weight)`` (Gemma), not with a bias.
    Probed on a copy of the module, its forward called without hooks (ZeRO-3's would gather)."""
    weight = dict(norm.named_parameters()).get("weight")
    if [n for n, _ in norm.named_parameters()] != ["weight"] or getattr(weight, "ds_numel", weight.numel()) != size:
        return False
    probe, gen = copy.copy(norm), torch.Generator().manual_seed(0)
    x, w = torch.randn(2, size, generator=gen), torch.rand(size, generator=gen) + 0.5
    outputs = []
    for scale in (1.0, 2.0):
        probe._parameters = {"weight": torch.nn.Parameter(w * scale, requires_grad=False)}
        with torch.no_grad():
            outputs.append(type(norm).forward(probe, x).float())
    return torch.allclose(outputs[1], 2 * outputs[0], rtol=1e-5, atol=0)


def _looks_like_attention(module) -> bool:
    """Named like attention with no attention inside (BERT's ``BertAttention`` holds the layer)."""
    return type(module).__name__.endswith("Attention") and not any(
        type(m).__name__.endswith("Attention") for _, m in module.named_modules() if m is not module)


def find_attention(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module, AttentionHeads]]:
    """``(name, module, heads)`` of every attention layer of ``model``: marked or of a known layout.

    Raises:
        ValueError: naming the key and each module named like attention in no known layout or on an attention
            implementation other than eager and sdpa; or no attention layer at all.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    found, problems = [], []
    for name, module in model.named_modules():
        heads, what = getattr(module, MARK_ATTR, None), f"{name} ({type(module).__name__})"
        if heads is None:
            if not _looks_like_attention(module):
                continue
            heads, config = describe_attention(module), getattr(module, "config", None)
            implementation = getattr(config, "_attn_implementation", None)
            if heads is None:
                problems.append(f"{what}: its query and key projections are not in a layout QK-clip knows "
                                "(q_proj/k_proj with heads from the config and an RMSNorm q_norm if any, qkv_proj, "
                                "GPT-2's c_attn; self-attention); freeze it, or describe it with "
                                "deepspeed.runtime.zero.muon.qk_clip.mark_attention and report its logits with "
                                "record_max_logits.")
                continue
            bypass = {
                "attention implementation " + repr(implementation):
                implementation not in RECORDED_IMPLEMENTATIONS,
                "eager attention without eager_attention_forward":
                implementation == "eager"
                and not hasattr(importlib.import_module(type(module).__module__), "eager_attention_forward"),
                "reorder_and_upcast_attn":
                implementation == "eager" and getattr(module, "reorder_and_upcast_attn", 0),
                "attn_logit_softcapping":
                getattr(config, "attn_logit_softcapping", None) is not None,
                "a local sdpa override (Ulysses)":
                "sdpa" in getattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", {}),
            }
            if any(bypass.values()):
                problems.append(
                    f"{what} runs {', '.join(k for k, v in bypass.items() if v)}, whose logits QK-clip "
                    "does not record; load the model with attn_implementation 'eager' or 'sdpa' (a model of your own: "
                    "mark_attention).")
                continue
        trainable = {p.requires_grad for span in heads.spans for p in (span.param, )}
        if trainable == {True}:
            found.append((name, module, heads))
        elif trainable != {False}:  # a frozen layer is left as it is
            problems.append(f"{what}: some of the weights QK-clip scales are frozen and some are not.")
    if not found and not problems:
        problems.append("the model has no attention layer QK-clip knows; describe yours with mark_attention.")
    if problems:
        raise ValueError(f"{_WHERE}: QK-clip cannot clip every attention layer:\n" + "\n".join(f"- {p}"
                                                                                               for p in problems))
    return found


@dataclass(frozen=True)
class ParamPiece:
    """A parameter's flattened elements ``[start, start + numel)`` at ``offset`` of this rank's fp32 partition."""
    param: torch.nn.Parameter
    start: int
    offset: int
    numel: int


def check_threshold(value) -> Optional[float]:
    """``qk_clip_threshold`` as a float, None where off; ValueError naming it for another value."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{_WHERE}: {value!r}; the largest attention logit QK-clip lets a head keep, a finite number "
                         "> 0 (Kimi K2 used 100), or null (the default) for no clipping.")
    return None if value is None else float(value)


class QKClip:
    """The clip of one engine's attention layers: ``layers`` from ``find_attention``, ``pieces`` per ZeRO group
    key, the maxima reduced over ``process_group`` (data-parallel) on ``device``. ``last_max``: fp32
    ``(layers x heads)`` maxima of the last step; ``heads_clipped``, ``steps``: since rank 0's last log."""

    def __init__(self, threshold, layers, pieces, process_group, device, steps_per_print=0):
        self.threshold = threshold
        self.names, self.modules, self.layers = (list(column) for column in zip(*layers))
        self.offsets = [sum(heads.num_heads for heads in self.layers[:i]) for i in range(len(self.layers) + 1)]
        self.maxima = torch.full((self.offsets[-1], ), float("-inf"), dtype=torch.float32, device=device)
        self.spans: Dict[int, List[Tuple[HeadSpan, int]]] = {}
        for index, heads in enumerate(self.layers):
            for span in heads.spans:
                self.spans.setdefault(id(span.param), []).append((span, index))
        self.pieces = {key: [p for p in ps if id(p.param) in self.spans] for key, ps in pieces.items()}
        self.process_group, self.steps_per_print = process_group, steps_per_print
        self.gamma: Optional[torch.Tensor] = None  # the step's, once reduced
        self.last_max: Optional[torch.Tensor] = None
        self.heads_clipped = self.steps = 0
        self._lines: Dict[Tuple[int, torch.device], torch.Tensor] = {}
        for index, module in enumerate(self.modules):
            _RECORDING[module] = (weakref.ref(self), index)
        install_recorders([m for m in self.modules if getattr(m, MARK_ATTR, None) is None])

    @classmethod
    def create(cls, engine) -> Optional["QKClip"]:
        """The engine's clip (None where off), once its ZeRO optimizer is built (``_qk_clip_pieces``).

        Raises:
            ValueError: naming the key: a bad value, stage 0, ``BF16_Optimizer``, AutoTP, ``find_attention``'s.
        """
        threshold = check_threshold((engine.optimizer_params() or {}).get(THRESHOLD_KEY))
        if threshold is None:
            return None
        from deepspeed.runtime.zero.muon.support import where_no_owner_runs
        where = where_no_owner_runs(engine)
        if where is not None or type(
                engine.optimizer).__name__ not in ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"):
            raise ValueError(f"{_WHERE}: QK-clip runs at ZeRO stages 1 to 3 (it scales the fp32 partitions in the "
                             f"ZeRO step), not with {where or type(engine.optimizer).__name__}.")
        if engine.autotp_size() > 1:
            raise ValueError(f"{_WHERE}: QK-clip needs each attention layer's heads on every rank; with "
                             f"tensor_parallel.autotp_size {engine.autotp_size()} they are split.")
        from deepspeed.accelerator import get_accelerator
        clip = cls(threshold, find_attention(engine.module), engine.optimizer._qk_clip_pieces(),
                   engine.optimizer.dp_process_group, torch.device(get_accelerator().current_device_name()),
                   engine.steps_per_print() or 0)
        if dist.get_rank() == 0:
            logger.info(f"QK-clip ({THRESHOLD_KEY} {threshold:g}): {len(clip.layers)} attention layers, "
                        f"{clip.offsets[-1]} heads; logits recorded on the eager and sdpa paths.")
        return clip

    def _reduce(self) -> torch.Tensor:
        """Every head's fp32 ``gamma`` from one MAX all-reduce of the maxima (one copy to the host). A head no rank
        recorded (its layer in eval mode or skipped), or whose logit overflowed, is not clipped; rank 0 warns."""
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
    def apply(self, key: int, flat: torch.Tensor) -> None:
        """Scale this rank's pieces in group ``key``'s fp32 partition ``flat``, right after the inner optimizer step
        (the step's first call, on every rank in the same order, reduces the maxima)."""
        if self.gamma is None:
            self.gamma, self._lines = self._reduce(), {}
        for piece in self.pieces.get(key, ()):
            scale = self._piece_scale(piece, flat.device)
            if scale is not None:
                flat.narrow(0, piece.offset, piece.numel).mul_(scale)

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

    def _piece_scale(self, piece: ParamPiece, device) -> Optional[torch.Tensor]:
        """The fp32 scale of each element of ``piece``, read off the rows it covers."""
        if piece.numel == 0:
            return None
        entry = self._line(piece.param, device)
        if entry is None:
            return None
        line, dim, shape = entry
        if len(shape) == 1:
            return line[piece.start:piece.start + piece.numel]
        width = math.prod(shape[1:])
        first, last = piece.start // width, (piece.start + piece.numel - 1) // width + 1
        if dim == 0:
            rows = line[first:last, None].expand(-1, width)
        else:
            rows = line[None, :].expand(last - first, -1)
        skip = piece.start - first * width
        return rows.reshape(-1)[skip:skip + piece.numel]

    def end_step(self) -> None:
        """Start the next step's maxima (the engine calls this after every optimizer step, taken or skipped); rank 0
        logs the heads clipped every ``steps_per_print`` steps."""
        self.maxima.fill_(float("-inf"))
        self.steps, self.gamma = self.steps + (self.gamma is not None), None
        if self.steps and self.steps_per_print and self.steps % self.steps_per_print == 0:
            if dist.get_rank() == 0:
                logger.info(f"QK-clip: {self.heads_clipped} head-steps clipped over the last {self.steps} steps "
                            f"({self.offsets[-1]} heads; {THRESHOLD_KEY} {self.threshold:g}; largest logit of "
                            f"the last step {float(self.last_max.max()):.4g})")
            self.heads_clipped = self.steps = 0
