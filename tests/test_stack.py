"""The software stack as an input (issue 8): the sourced table, lazy vs eager context, the default attention
per transformers version, cuBLAS workspaces, PYTORCH_CUDA_ALLOC_CONF, and bad input on the CLI."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from planner.cli.main import app
from planner.errors import PlannerError
from planner.estimate import estimate
from planner.hardware import get_gpu, get_instance
from planner.memory import stack as sw
from planner.spec import FAMILIES, SoftwareStack, TrainConfig

runner = CliRunner()
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
V100 = get_instance("ml.p3.2xlarge").gpu


def st(torch: str, cuda: str, tf: str = "5.23", **kw) -> SoftwareStack:
    return SoftwareStack(torch=torch, cuda=cuda, transformers=tf, given=True, **kw)


# ---- the table: every row sourced and dated -------------------------------------------------------


def test_every_torch_row_has_cuda_builds_a_source_and_a_date():
    t = sw.table()
    assert DATE.match(t["checked"])
    versions = [sw.parse_version("v", r["version"]) for r in t["torch"]]
    assert versions == sorted(versions) and versions[0] <= (1, 7)  # torch 1.7 (and older) to today, in order
    for row in t["torch"]:
        assert row["source"] and row["cuda"], row
        assert row["released"] == "" or DATE.match(row["released"]), row
        for c in row["cuda"]:
            sw.parse_version("cuda", c)


def test_every_other_section_has_a_source_and_a_date():
    t = sw.table()
    for section in ("module_loading", "eager_context_mib", "lazy_context_band", "defaulted_stack_widening",
                    "sdpa_default", "cublas_workspace", "alloc_conf", "ngc", "zero_grad"):
        assert DATE.match(t[section]["date"]), section
        assert "source" in t[section] or all("source" in r for r in t[section].get("rules", [])), section
    for fam in FAMILIES:  # every model family the catalog has gets a sourced, dated row
        row = t["sdpa_default"]["families"][fam]
        assert row["source"] and DATE.match(row["released"]), fam
    for rule in t["cublas_workspace"]["rules"]:
        assert rule["source"]
    for key, row in t["alloc_conf"]["keys"].items():
        assert row["source"] and sw.parse_version(key, row["since"]), key


def test_the_default_stack_is_the_dlc_probe_launch_uses():
    from planner.aws.images import choose_image

    for name in ("ml.p3.2xlarge", "ml.g5.xlarge", "ml.p4d.24xlarge"):
        inst = get_instance(name)
        dlc = choose_image(name, "us-east-1")
        s = sw.default_stack(inst.gpu)
        assert dlc.framework_version.startswith(s.torch + ".")
        assert f"cu{s.cuda.replace('.', '')}" in dlc.uri
        assert not s.given and "probe launch" in s.source
        sw.check_cuda(s.torch, s.cuda)  # the DLC's pair is in the table
        sw.check_transformers(s.transformers)


# ---- context: lazy vs eager module loading --------------------------------------------------------


@pytest.mark.parametrize(("torch", "cuda", "lazy"), [
    ("1.12", "11.6", False),  # torch sets CUDA_MODULE_LOADING=LAZY only from 1.13 (PR #86509)
    ("1.13", "11.6", False),  # CUDA 11.6 has no lazy loading
    ("1.13", "11.7", True),
    ("1.7", "11.0", False),
    ("2.8", "12.9", True),
])
def test_lazy_loading_needs_cuda_11_7_and_torch_1_13(torch, cuda, lazy):
    assert sw.lazy_loading(st(torch, cuda)) is lazy


def test_eager_context_is_larger_than_lazy_and_matches_published_figures():
    cfg = TrainConfig(batch_size=8, seq_len=128, precision="amp-fp16")
    lazy = estimate("roberta-base", cfg, "ml.p3.2xlarge", stack={"torch": "1.13", "cuda": "11.7"},
                    with_throughput=False)
    eager = estimate("roberta-base", cfg, "ml.p3.2xlarge", stack={"torch": "1.12", "cuda": "11.3"},
                     with_throughput=False)
    # PR #86509: 666,632,192 B eager vs 287,047,680 B lazy after one tensor: eager loads far more.
    assert eager.runtime.cuda_context_bytes > lazy.runtime.cuda_context_bytes + 287_047_680
    ctx = {t.name: t for t in eager.band}["cuda_context"]
    # ptrblck (pytorch#107667): ">1000MB" before CUDA 11.7; published 1-1.4 GB on V100: inside the band
    # (plus cuBLAS's own workspaces, outside the allocator before torch 1.13, PR #83461).
    ws = sw.cublas_workspace_bytes(eager.stack, (7, 0), 2)
    assert eager.runtime.cublas_workspace_bytes == 0
    assert lazy.runtime.cublas_workspace_bytes == sw.cublas_workspace_bytes(lazy.stack, (7, 0), 2)
    assert ctx.low - ws <= 1000 * 2**20 and ctx.high - ws >= 1400 * 2**20
    assert "eager" in ctx.basis and "lazy" in {t.name: t for t in lazy.band}["cuda_context"].basis


def test_context_override_has_no_band_and_wins_over_the_stack():
    est = estimate("roberta-base", TrainConfig(batch_size=8, seq_len=128), "ml.p3.2xlarge",
                   runtime={"cuda_context_bytes": 900 * 2**20}, stack={"torch": "1.8"}, with_throughput=False)
    ctx = {t.name: t for t in est.band}["cuda_context"]
    assert ctx.low == ctx.point == ctx.high == est.runtime.cuda_context_bytes == 900 * 2**20


def test_a_defaulted_stack_has_a_wider_context_band_than_the_same_stack_given():
    cfg = TrainConfig(batch_size=8, seq_len=128)
    default = estimate("bert-base-uncased", cfg, "ml.p3.2xlarge", with_throughput=False)
    given = estimate("bert-base-uncased", cfg, "ml.p3.2xlarge", stack=default.stack.model_dump() | {"given": True},
                     with_throughput=False)
    d, g = ({t.name: t for t in e.band}["cuda_context"] for e in (default, given))
    assert d.point == g.point and d.high > g.high


# ---- the default attention kernel ----------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_default_attention_switches_at_the_sourced_version(family):
    if sw.table()["sdpa_default"]["families"][family]["since"] is None:  # never SDPA by default (gpt-oss)
        assert sw.default_attention(st("2.9", "12.8", "5.23"), family) == "eager"
        return
    since = sw.parse_version("since", sw.table()["sdpa_default"]["families"][family]["since"])
    before = f"{since[0]}.{since[1] - 1}"
    at = f"{since[0]}.{since[1]}"
    assert sw.default_attention(st("2.4", "12.1", before), family) == "eager"
    assert sw.default_attention(st("2.4", "12.1", at), family) == "sdpa"
    # transformers needs torch >= 2.1.1 for SDPA (import_utils.is_torch_sdpa_available): eager on 2.0 / 2.1.0.
    assert sw.default_attention(st("2.0", "11.8", at), family) == "eager"
    assert sw.default_attention(st("2.1", "12.1", at), family) == "eager"


HF_CLASSES = {"bert": ("BertConfig", "BertModel"), "roberta": ("RobertaConfig", "RobertaModel"),
              "distilbert": ("DistilBertConfig", "DistilBertModel"), "gpt2": ("GPT2Config", "GPT2Model"),
              "llama": ("LlamaConfig", "LlamaModel"), "mistral": ("MistralConfig", "MistralModel"),
              "mixtral": ("MixtralConfig", "MixtralModel"), "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeModel"),
              "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeModel"), "olmoe": ("OlmoeConfig", "OlmoeModel"),
              "gpt_oss": ("GptOssConfig", "GptOssModel"), "deepseek_v2": ("DeepseekV2Config", "DeepseekV2Model"),
              "deepseek_v3": ("DeepseekV3Config", "DeepseekV3Model")}


@pytest.mark.parametrize("family", FAMILIES)
def test_default_attention_matches_what_installed_transformers_picks(family):
    """The installed transformers and torch decide for real; our table must agree for their versions."""
    import torch
    import transformers

    cfg_name, model_name = HF_CLASSES[family]
    tiny = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64, vocab_size=64)
    if family == "distilbert":
        tiny = dict(dim=32, n_heads=2, n_layers=1, hidden_dim=64, vocab_size=64)
    if family == "gpt2":
        tiny = dict(n_embd=32, n_head=2, n_layer=1, vocab_size=64)
    config = getattr(transformers, cfg_name)(**tiny)
    with torch.device("meta"):
        model = getattr(transformers, model_name)(config)
    real = model.config._attn_implementation
    ours = sw.default_attention(st(sw.fmt(sw.parse_version("t", torch.__version__)), "12.8",
                                   sw.fmt(sw.parse_version("t", transformers.__version__))), family)
    assert real == ours


def test_auto_attention_resolves_from_the_stack_and_explicit_values_stay():
    cfg = TrainConfig(batch_size=8, seq_len=128)
    assert cfg.attention == "auto"
    old = estimate("roberta-base", cfg, "ml.p3.2xlarge", stack={"torch": "2.3", "transformers": "4.45"},
                   with_throughput=False)
    new = estimate("roberta-base", cfg, "ml.p3.2xlarge", stack={"torch": "2.3", "transformers": "4.46"},
                   with_throughput=False)
    assert (old.config.attention, new.config.attention) == ("eager", "sdpa")
    assert old.memory_bytes.activations > new.memory_bytes.activations  # eager keeps the s^2 scores
    explicit = estimate("roberta-base", cfg.model_copy(update={"attention": "sdpa"}), "ml.p3.2xlarge",
                        stack={"torch": "2.3", "transformers": "4.45"}, with_throughput=False)
    assert explicit.config.attention == "sdpa"


# ---- workspaces and allocator settings ------------------------------------------------------------


def test_cublas_workspace_follows_torch_version_and_hopper():
    h100 = (9, 0)
    new = sw.cublas_workspace_bytes(st("2.8", "12.8"), h100, 1)
    old = sw.cublas_workspace_bytes(st("2.2", "12.1"), h100, 1)
    assert new - old == (32768 - 8320) * 1024  # PR #120925: 32 MiB cuBLAS workspace on Hopper from 2.3
    # ":4096:2:16:8" = 2 x 4096 KiB + 8 x 16 KiB (CublasHandlePool.cpp), + 1 MiB cuBLASLt
    assert sw.cublas_workspace_bytes(st("2.8", "12.8"), (7, 0), 1) == 2 * 4096 * 1024 + 8 * 16 * 1024 + 1024 * 1024


def test_alloc_conf_parses_the_real_keys():
    conf = "expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:[256:1,>:4]"
    out = sw.parse_alloc_conf(conf, "2.8")
    assert out == {"expandable_segments": "True", "max_split_size_mb": "128",
                   "roundup_power2_divisions": "[256:1,>:4]"}
    assert st("2.8", "12.8", alloc_conf="expandable_segments:True").expandable_segments
    assert not st("2.8", "12.8").expandable_segments


@pytest.mark.parametrize(("conf", "torch", "needle"), [
    ("expandable_segment:True", "2.8", "expandable_segments"),  # typo: names the closest key
    ("expandable_segments:yes", "2.8", "True or False"),
    ("expandable_segments:True", "2.0", "from torch 2.1"),
    ("max_split_size_mb", "2.8", "KEY:VALUE"),
    ("garbage_collection_threshold:1.5", "2.8", "(0, 1)"),
])
def test_bad_alloc_conf_names_flag_and_value(conf, torch, needle):
    with pytest.raises(PlannerError) as e:
        sw.parse_alloc_conf(conf, torch)
    assert e.value.field == "--alloc-conf" and needle in str(e.value)


# ---- bad input on the CLI: one line, exit 2, names the flag and value ------------------------------


@pytest.mark.parametrize(("flags", "needles"), [
    (["--torch-version", "banana"], ["--torch-version", "banana", "MAJOR.MINOR"]),
    (["--torch-version", "0.4"], ["--torch-version", "0.4", "closest known: 1.2"]),
    (["--torch-version", "2.40"], ["--torch-version", "closest known: 2.15"]),
    # a pair that cannot exist: torch 1.12 predates CUDA 12 (11.7, which no pip build has, is accepted with a note)
    (["--torch-version", "1.12", "--cuda-version", "12.1"], ["--cuda-version", "12.1", "closest known: 11.6"]),
    (["--torch-version", "2.8", "--cuda-version", "12.7"], ["--cuda-version", "no such CUDA release"]),
    (["--transformers-version", "1.2"], ["--transformers-version", "1.2", "closest known: 2.0"]),
    (["--transformers-version", "3.9"], ["--transformers-version", "3.9", "closest known: 3.5"]),
    (["--transformers-version", "4.x"], ["--transformers-version", "4.x"]),
    (["--alloc-conf", "expandable:True"], ["--alloc-conf", "expandable:True", "expandable_segments"]),
])
@pytest.mark.parametrize("command", ["estimate", "explain"])
def test_bad_stack_input_is_one_line_exit_2(command, flags, needles):
    r = runner.invoke(app, [command, "-m", "bert-base-uncased", "-i", "ml.p3.2xlarge", "-b", "8", "-s", "128",
                            *flags])
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert "Traceback" not in r.output and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)


def test_json_names_the_stack_and_the_resolved_attention():
    r = runner.invoke(app, ["estimate", "-m", "roberta-base", "-i", "ml.p3.2xlarge", "-b", "8", "-s", "128",
                            "--torch-version", "2.0", "--alloc-conf", "max_split_size_mb:256", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["stack"]["torch"] == "2.0" and out["stack"]["cuda"] == "11.8" and out["stack"]["given"]
    assert out["stack"]["alloc_conf"] == "max_split_size_mb:256"
    assert out["config"]["attention"] == "eager"  # torch 2.0: transformers' SDPA needs >= 2.1.1
    assert out["verdict"] in ("fits", "tight", "oom") and out["fits"] == (out["verdict"] == "fits")


def test_text_output_names_the_stack():
    r = runner.invoke(app, ["estimate", "-m", "gpt2", "-i", "ml.g5.2xlarge", "-b", "4", "-s", "256"])
    assert r.exit_code == 0, r.output
    assert "Stack: torch" in r.stdout and "probe launch" in r.stdout


def test_ngc_containers_map_to_known_stacks():
    """NGC release notes: 20.06 ships PyTorch 1.6 with CUDA 11.0 (eager loading), 21.11 PyTorch 1.11 / CUDA 11.5."""
    assert sw.ngc_stack("NGC pytorch:20.06-py3; NVIDIA modeling.py") == {"torch": "1.6", "cuda": "11.0"}
    assert sw.ngc_stack("no container named") is None
    # Lambda's 2020 runs (deeplearning-benchmark pytorch/README.md: 'version: 0 for pytorch:20.01-py3')
    assert sw.ngc_stack("in NGC pytorch:20.01-py3 (build 9332039)") == {"torch": "1.4", "cuda": "10.2"}
    for tag, row in sw.table()["ngc"]["containers"].items():
        assert row["source"] and sw.check_cuda(sw.check_torch(row["torch"]), row["cuda"]), tag
        assert not sw.lazy_loading(st(row["torch"], row["cuda"]))  # all before CUDA 11.7: eager contexts


def test_expandable_segments_from_the_stack_reach_the_allocator_replay():
    cfg = TrainConfig(batch_size=16, seq_len=256, precision="amp-fp16")
    plain = estimate("bert-base-uncased", cfg, "ml.p3.2xlarge", with_throughput=False)
    exp = estimate("bert-base-uncased", cfg, "ml.p3.2xlarge", stack={"alloc_conf": "expandable_segments:True"},
                   with_throughput=False)
    assert plain.allocator is not None and exp.allocator is not None
    assert not plain.allocator.expandable_segments and exp.allocator.expandable_segments
    assert exp.stack.alloc_conf == "expandable_segments:True"


# ---- zero_grad(): gradients freed (torch >= 2.0) or kept as zeros (before) ------------------------------


def test_installed_torch_zero_grad_frees_gradients_as_the_table_says():
    """The table's boundary checked against the real default of the installed torch (>= 2.0): zero_grad()
    sets .grad to None, for optimizers and modules alike; set_to_none=False (the pre-2.0 default, PR #92731)
    keeps the same gradient tensor, filled with zeros: that tensor stays allocated into the next step."""
    import inspect

    import torch

    installed = st(sw.fmt(sw.parse_version("torch", torch.__version__)), "12.8")
    assert not sw.zero_grad_keeps_gradients(installed, "single")
    assert inspect.signature(torch.optim.Optimizer.zero_grad).parameters["set_to_none"].default is True
    assert inspect.signature(torch.nn.Module.zero_grad).parameters["set_to_none"].default is True
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.ones(2, 4)).sum().backward()
    kept = lin.weight.grad
    opt.zero_grad(set_to_none=False)  # what zero_grad() did before torch 2.0
    assert lin.weight.grad is kept and not kept.any()
    opt.zero_grad()
    assert lin.weight.grad is None


@pytest.mark.parametrize("torch,par,impl,keeps", [
    ("1.4", "single", "for-loop", True), ("1.13", "ddp", "foreach", True), ("1.13", "dp", "foreach", True),
    ("2.0", "single", "foreach", False), ("1.13", "zero2", "foreach", False),
    ("1.7", "single", "fused", False),  # apex FusedAdam: zero_grad() sets None (set_grad_none=True)
])
def test_zero_grad_keeps_gradients_before_torch_2_0(torch, par, impl, keeps):
    assert sw.zero_grad_keeps_gradients(st(torch, sw.table()["torch"][0]["cuda"][0]), par, impl) is keeps


def test_old_stack_keeps_the_gradients_through_forward_and_backward():
    """torch 1.13: the forward phase already holds every gradient (zeros from the last zero_grad()), so the
    peak grows by at most the gradient bytes; torch 2.x: no gradient in the forward."""
    cfg = TrainConfig(batch_size=8, seq_len=128, precision="fp32", attention="eager")
    old = estimate("bert-base-uncased", cfg, "ml.p3.2xlarge", stack={"torch": "1.13", "cuda": "11.7"},
                   with_throughput=False)
    new = estimate("bert-base-uncased", cfg, "ml.p3.2xlarge", stack={"torch": "2.0", "cuda": "11.7"},
                   with_throughput=False)
    grads = old.memory_bytes.gradients
    fwd_old = next(p for p in old.phases if p.phase == "forward")
    fwd_new = next(p for p in new.phases if p.phase == "forward")
    assert fwd_old.detail["gradients"] == grads > 0 and fwd_new.detail["gradients"] == 0
    gain = old.memory_bytes.peak_allocated - new.memory_bytes.peak_allocated
    assert 0 < gain <= grads


# ---- pairs pip never shipped (issue 22): containers, conda ---------------------------------------------------


def test_a_container_pair_is_accepted_and_says_which_container():
    stack = sw.resolve_stack({"torch": "1.7", "cuda": "11.1"}, get_gpu("V100"))
    assert (stack.torch, stack.cuda) == ("1.7", "11.1")
    assert "NGC pytorch:20.10-py3" in stack.source
    assert sw.lazy_loading(stack) is False  # CUDA 11.1 < 11.7: eager module loading, whatever the build


def test_an_unlisted_minor_gets_the_nearest_listed_behaviour_with_a_note():
    stack = sw.resolve_stack({"torch": "1.12", "cuda": "11.7"}, get_gpu("A100"))
    assert "nearest listed build, CUDA 11.6" in stack.source
    assert sw.cuda_note("2.8", "12.9") == ""  # a pip build needs no note


def test_cli_accepts_torch_1_7_with_cuda_11_1_with_a_note():
    r = runner.invoke(app, ["estimate", "-m", "bert-base-uncased", "-i", "ml.p3.2xlarge", "-b", "8", "-s", "128",
                            "--torch-version", "1.7", "--cuda-version", "11.1", "--json"])
    assert r.exit_code == 0, r.output
    assert "NGC pytorch:20.10-py3" in json.loads(r.stdout)["stack"]["source"]
