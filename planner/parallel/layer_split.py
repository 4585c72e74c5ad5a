"""How each framework splits a model's transformer layers over pipeline model chunks (issue 35: uneven stages).

A pipeline of pp ranks with vp virtual stages each runs pp · vp model chunks; chunk c (c = v · pp + r, the
"loop" placement) runs on rank r = c mod pp, and the layers fill the chunks in order. What differs between
frameworks is how many layers each chunk gets when they do not divide evenly, and whether the embedding and
the LM head count as layers. Each rule below is the framework's own function transcribed, with its source:

- "even" (a plain PyTorch loop, Accelerate, Lightning, DeepSpeed): layers / (pp · vp) per chunk; layers that do
  not divide are refused (the planner's rule before issue 35; DeepSpeed's pipeline engine partitions by
  parameters, not modelled).
- "megatron": NVIDIA/Megatron-LM megatron/core/transformer/transformer_block.py get_num_layers_to_build and
  transformer_layer.py get_transformer_layer_offset (@d98e8a64dd). Without `--decoder-first-pipeline-num-layers`
  / `--decoder-last-pipeline-num-layers` the layers must divide pp (asserted), then vp; with them (the planner's
  `--first-stage-layers` / `--last-stage-layers`) the first (last) rank holds that many, split over its vp
  chunks, and the rest divide evenly over the middle ranks ("With uneven pipelineing the left over layers must
  be divisible by left over stages"); each rank's count must divide by vp. With
  `--account-for-embedding-in-pipeline-split` / `--account-for-loss-in-pipeline-split` (the planner's
  `--account-for-embedding` / `--account-for-loss`) the embedding / the loss count as one layer: layers + 1
  (+ 1) divide pp, then vp, and the first chunk of rank 0 (the last chunk of the last rank) builds one fewer.
  With `--pipeline-model-parallel-layout` (the planner's `--pp-layout`, e.g. DeepSeek-V3's
  "Et*3|(tt|)*29|L" at pp 16 × vp 2) each chunk holds the decoder layers its stage string names
  (transformer/pipeline_parallel_layer_layout.py). The offsets put round v's chunks in rank order, so layers
  stay contiguous in chunk order.
- "torchtitan": pytorch/torchtitan torchtitan/distributed/pipeline_parallel.py generate_llm_fqn_per_model_part
  (@fb3b230e): the embedding and the norm + output count as `input_weight` and `output_weight` layers
  (job config `pipeline_parallel_first_stage_less_layers` / `_last_stage_less_layers`, both 1 by default);
  (layers + 2) // stages each, the first (layers + 2) % stages stages one more; the first stage then holds
  that less input_weight layers, the last less output_weight.
- "nemo-automodel": NVIDIA-NeMo/Automodel nemo_automodel/components/distributed/pipelining/functional.py
  generate_hf_model_fqn_per_model_part (@cb976544 and @89e3a9fd, unchanged in between): layers // stages each,
  the first layers % stages stages one more; the embedding on the first stage and the norm and lm_head on
  the last, not counted. stage_ids_this_rank(style="loop"): stage s on rank s mod pp.

The answer is a tuple of layers per chunk, in chunk order; the pipeline (planner.memory.stages) maps a layer
to its chunk and rank from it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from planner.errors import PlannerError

SplitRule = Literal["even", "megatron", "torchtitan", "nemo-automodel"]
SPLIT_RULES: tuple[str, ...] = ("even", "megatron", "torchtitan", "nemo-automodel")

# torchtitan's JobConfig defaults (torchtitan/config/job_config.py Parallelism:
# pipeline_parallel_first_stage_less_layers: int = 1, pipeline_parallel_last_stage_less_layers: int = 1).
TORCHTITAN_INPUT_WEIGHT = 1
TORCHTITAN_OUTPUT_WEIGHT = 1

FIRST_FLAG, LAST_FLAG = "--first-stage-layers", "--last-stage-layers"
EMBEDDING_FLAG, LOSS_FLAG = "--account-for-embedding", "--account-for-loss"
LAYOUT_FLAG = "--pp-layout"

# The TrainConfig fields of an uneven split: the `chunk_layers` keyword and the flag of each. One table for
# the layout check (planner.parallel.dims), the search's pipeline degrees (planner.search.space), the probe's
# refusal (planner.probes.spec) and explain's doubled pipeline (planner.explain_parallel).
SPLIT_FIELDS: dict[str, tuple[str, str]] = {
    "first_stage_layers": ("first", FIRST_FLAG), "last_stage_layers": ("last", LAST_FLAG),
    "account_for_embedding": ("embedding", EMBEDDING_FLAG), "account_for_loss": ("loss", LOSS_FLAG),
    "pp_layout": ("layout", LAYOUT_FLAG)}


def given_split(values: Mapping[str, Any]) -> dict[str, Any]:
    """The uneven-split fields among `values` (a config's fields, or a search's fixed ones) that are set: not
    None and not False. 0 layers is set (Megatron's first or last stage without a decoder layer), though
    `0 in (None, False)` holds in Python."""
    return {f: v for f in SPLIT_FIELDS if f in values and (v := values[f]) is not None and v is not False}


def split_kwargs(values: Mapping[str, Any]) -> dict[str, Any]:
    """`chunk_layers`' keywords for the uneven-split fields set among `values`."""
    return {SPLIT_FIELDS[f][0]: v for f, v in given_split(values).items()}


def chunk_layers(rule: str, layers: int, pp: int, vp: int = 1, *, first: int | None = None,
                 last: int | None = None, embedding: bool = False, loss: bool = False,
                 layout: str | None = None) -> tuple[int, ...]:
    """Layers in each of the pp · vp model chunks, in chunk order (module docstring), or a PlannerError naming
    the flag and what the framework allows. `first` / `last`: Megatron's layers on the first / last rank;
    `embedding` / `loss`: Megatron's --account-for-embedding/loss-in-pipeline-split (the embedding / the loss
    counted as one layer of the first / last chunk); `layout`: Megatron's --pipeline-model-parallel-layout."""
    chunks = pp * vp
    if (first is not None or last is not None) and rule != "megatron":
        raise PlannerError(FIRST_FLAG if first is not None else LAST_FLAG, first if first is not None else last,
                           "only with --framework megatron (Megatron-LM's --decoder-first/last-pipeline-num-"
                           "layers; this framework splits the layers by its own rule)")
    if layout is not None:
        if rule != "megatron":
            raise PlannerError(LAYOUT_FLAG, layout, "only with --framework megatron (Megatron-LM's "
                               "--pipeline-model-parallel-layout)")
        if first is not None or last is not None or embedding or loss:
            raise PlannerError(LAYOUT_FLAG, layout, f"alone: not with {FIRST_FLAG}, {LAST_FLAG}, {EMBEDDING_FLAG} "
                               f"or {LOSS_FLAG} (Megatron refuses them together)")
        return layout_chunks(layout, layers, pp, vp)
    if (embedding or loss) and rule != "megatron":
        raise PlannerError(EMBEDDING_FLAG if embedding else LOSS_FLAG, True,
                           "only with --framework megatron (Megatron-LM's --account-for-embedding/loss-in-"
                           "pipeline-split)")
    if chunks > layers and rule not in ("megatron", "torchtitan"):
        raise PlannerError("--pp", pp, f"at most {layers} stages × virtual stages: the model has {layers} layers")
    if rule == "megatron":
        if embedding or loss:
            return _megatron_accounted(layers, pp, vp, first, last, embedding, loss)
        return _megatron(layers, pp, vp, first, last)
    if rule == "torchtitan":
        return _torchtitan(layers, chunks)
    if rule == "nemo-automodel":
        base, extra = divmod(layers, chunks)
        return tuple(base + (1 if s < extra else 0) for s in range(chunks))
    if layers % chunks:
        raise PlannerError("--pp/--vp", f"{pp}×{vp}", f"a product that divides the model's {layers} layers "
                           "(this framework splits layers evenly)")
    return (layers // chunks,) * chunks


def _megatron(layers: int, pp: int, vp: int, first: int | None, last: int | None) -> tuple[int, ...]:
    """get_num_layers_to_build for every (rank, virtual stage), in chunk order v · pp + r."""
    for flag, value in ((FIRST_FLAG, first), (LAST_FLAG, last)):
        if value is not None and (pp < 2 or value < 0 or value > layers):
            raise PlannerError(flag, value, f"0 to {layers} layers with --pp above 1")
        if value is not None and value % vp:
            raise PlannerError(flag, value, f"a multiple of --vp {vp} (each virtual stage of the rank the same)")
    if first is None and last is None:
        if layers % pp or (layers // pp) % vp:
            raise PlannerError("--pp/--vp", f"{pp}×{vp}", f"a product that divides the model's {layers} layers, "
                               f"or {FIRST_FLAG} / {LAST_FLAG} (Megatron's uneven first and last stages)")
        per_rank = [layers // pp] * pp
    else:
        rest, middle = layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
        if rest < 0 or (middle > 0 and rest % middle) or (middle == 0 and rest):
            raise PlannerError(FIRST_FLAG if first is not None else LAST_FLAG, first if first is not None else last,
                               f"a count that leaves the other {middle} ranks an equal share of the "
                               f"{layers} layers")
        per_rank = [rest // middle if middle else 0] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
        bad = next((r for r in range(pp) if per_rank[r] % vp), None)
        if bad is not None:
            raise PlannerError("--vp", vp, f"a divisor of the {per_rank[bad]} layers of each middle rank")
    return tuple(per_rank[c % pp] // vp for c in range(pp * vp))


def _megatron_accounted(layers: int, pp: int, vp: int, first: int | None, last: int | None, embedding: bool,
                        loss: bool) -> tuple[int, ...]:
    """get_num_layers_to_build with account_for_embedding/loss_in_pipeline_split: layers + 1 (+ 1) divide pp,
    then vp; the first chunk of rank 0 builds one layer fewer for the embedding, the last chunk of the last
    rank one fewer for the loss (transformer_config.py refuses them with the uneven first/last stages)."""
    if first is not None or last is not None:
        raise PlannerError(EMBEDDING_FLAG if embedding else LOSS_FLAG, True,
                           f"not with {FIRST_FLAG} / {LAST_FLAG} (Megatron refuses both at once)")
    if pp < 2:
        raise PlannerError(EMBEDDING_FLAG if embedding else LOSS_FLAG, True, "only with --pp above 1")
    n = layers + embedding + loss
    if n % pp or (n // pp) % vp:
        raise PlannerError("--pp/--vp", f"{pp}×{vp}", f"a product that divides the model's {layers} layers + "
                           f"{int(embedding) + int(loss)} (the embedding and the loss counted as layers)")
    out = [n // pp // vp] * (pp * vp)
    out[0] -= embedding
    out[-1] -= loss
    if min(out) < 0:
        raise PlannerError("--pp/--vp", f"{pp}×{vp}", "fewer chunks: the first or last chunk holds no layer for "
                           "the embedding or the loss to replace")
    return tuple(out)


def parse_layout(layout: str) -> list[str]:
    """Megatron's layout string as one string of layer characters per model chunk, in chunk order
    (megatron/core/transformer/pipeline_parallel_layer_layout.py PipelineParallelLayerLayout.parse_str_to_list
    @d98e8a64dd: commas dropped, `(...)*n` then `x*n` unrolled, stages split at '|'; E embedding, t decoder
    layer, m multi-token prediction, L loss)."""
    text = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda x: x.group(1) * int(x.group(2)), text)
    stages = text.split("|")
    bad = next((c for stage in stages for c in stage if c not in "EtmL"), None)
    if bad is not None:
        raise PlannerError(LAYOUT_FLAG, layout, f"layer characters E, t, m and L with '|', '*n' and '(...)*n' "
                           f"(Megatron's layout syntax); {bad!r} is not one")
    return stages


def layout_chunks(layout: str, layers: int, pp: int, vp: int) -> tuple[int, ...]:
    """Decoder layers per chunk of a Megatron layout, with PipelineParallelLayerLayout's checks (the stages a
    multiple of pp, giving vp; the embedding first and the loss last, once each; as many decoder layers as
    the model has) and the planner's own: no multi-token prediction layer (not modelled), the embedding on
    rank 0 and the loss on the last rank (where the planner keeps the embedding and the head)."""
    stages = parse_layout(layout)
    if len(stages) % pp or len(stages) // pp != vp:
        raise PlannerError(LAYOUT_FLAG, layout, f"pp × vp = {pp} × {vp} stages separated by '|' (it has "
                           f"{len(stages)}; Megatron reads vp from the layout: give --vp {len(stages) // pp or 1})")
    flat = "".join(stages)
    if "m" in flat:
        raise PlannerError(LAYOUT_FLAG, layout, "no 'm': multi-token prediction layers are not modelled")
    if flat.count("E") != 1 or flat.count("L") != 1 or not flat.startswith("E") or not flat.endswith("L"):
        raise PlannerError(LAYOUT_FLAG, layout, "the embedding 'E' first and the loss 'L' last, once each")
    if flat.count("t") != layers:
        raise PlannerError(LAYOUT_FLAG, layout, f"{layers} decoder layers 't', as the model has "
                           f"(the layout has {flat.count('t')})")
    first_e = next(c for c, st in enumerate(stages) if "E" in st)
    last_l = next(c for c, st in enumerate(stages) if "L" in st)
    if first_e % pp != 0 or last_l % pp != pp - 1:
        raise PlannerError(LAYOUT_FLAG, layout, "the embedding in a chunk of the first rank and the loss in one "
                           "of the last rank (chunk c runs on rank c mod pp)")
    return tuple(st.count("t") for st in stages)


def _torchtitan(layers: int, stages: int) -> tuple[int, ...]:
    """generate_llm_fqn_per_model_part(stages, layers, input_weight=1, output_weight=1): layers per stage."""
    if stages == 1:
        return (layers,)
    win, wout = TORCHTITAN_INPUT_WEIGHT, TORCHTITAN_OUTPUT_WEIGHT
    effective = layers + win + wout
    base, extra = divmod(effective, stages)
    if base == 0 or win > base or wout > base:
        raise PlannerError("--pp/--vp", stages, f"at most {effective // max(win, wout, 1)} stages: torchtitan "
                           f"counts the embedding and the output as layers ({layers} + {win} + {wout})")
    out, placed = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0) - (win if s == 0 else wout if s == stages - 1 else 0)
        n = max(0, min(n, layers - placed))  # `if current_layer < num_layers`
        out.append(n)
        placed += n
    return tuple(out)


def rank_layers(chunks: tuple[int, ...], pp: int) -> tuple[int, ...]:
    """Layers each pipeline rank holds: its chunks r, r + pp, ..."""
    return tuple(sum(chunks[r::pp]) for r in range(pp))


def chunk_of_layer(chunks: tuple[int, ...]) -> tuple[int, ...]:
    """The chunk of every layer, in layer order."""
    return tuple(c for c, n in enumerate(chunks) for _ in range(n))
