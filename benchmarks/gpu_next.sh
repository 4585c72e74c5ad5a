#!/usr/bin/env bash
# The GPU readings issue 36's open questions wait for, in one device call, most decisive first.
#
# Here, first:   python benchmarks/gpu_session.py prepare        (refreshes .gpu/specs.json, committed: the
#                catalog specs as the probe job receives them; the GPU's python3 needs no planner install)
# On the GPU:    bash benchmarks/gpu_next.sh                      (run with timeout_s 560; files land in $OUT)
# Back here:     copy $OUT's files to results/validation/<gpu>/measured-<date>/ with a README (who, how,
#                held out), then: python benchmarks/memtrace_replay.py FOLDER; python benchmarks/passes_readings.py
#                FOLDER; and the scorecard.
#
# What each section settles (docs/allocator.md, docs/accuracy.md):
#   memtrace      the planner's allocator model against PyTorch's own on the same requests, segment for
#                 segment: whether the 3-8 % reserved misses are the model's rules or its predicted order
#   segments      the segments after every phase of the rows the per-block replay misses
#   passes        elementwise passes by operand dtype (Hopper's mixed-dtype rate, fitted to steps only)
#   xent          cross-entropy's saved tensors and peak under CUDA autocast
#   qlora_profile where QLoRA's step time goes (b1 is 43 % too fast; bitsandbytes' host cost is unknown)
#   fsdp          FSDP2 copy-in/out and hooks on one GPU (40 % too fast with autocast)
# Each section has its own time limit so that one slow section leaves the others their readings; at most
# 8 files come back (six sections' .jsonl, env.json, log.txt).
set -u
OUT=${OUT:-/tmp/gpu_next}
mkdir -p "$OUT"
for spec in memtrace:200 segments:50 passes:50 xent:40 qlora_profile:110 fsdp:100; do
  section=${spec%%:*}
  limit=${spec##*:}
  timeout "$limit" python3 benchmarks/gpu_session.py run --specs .gpu/specs.json --out "$OUT" --sections "$section" \
    || echo "section $section: stopped (exit $?)" >>"$OUT/log.txt"
done
ls -la "$OUT"
