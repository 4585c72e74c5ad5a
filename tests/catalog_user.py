"""A catalog model written out as user code (`--model FILE.py:build`), so the tracer can be checked against the
analytic core on the very module it describes (tests and benchmarks/trace_agreement.py share it)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path


def catalog_user_file(folder: Path, spec, filename: str = "model.py", checkpointable: bool = True) -> str:
    """Write `spec` and a `build`/`batch` module built by jobs.modeling into `folder`; return the module's path.

    checkpointable: give the multimodal model a `gradient_checkpointing_enable` (per-layer checkpointing of its
    BERT), as Hugging Face models have, so `checkpointing=True` configurations trace too."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.json").write_text(json.dumps(spec.model_dump(mode="json")))
    hook = """
            if not hasattr(model, "gradient_checkpointing_enable"):  # the multimodal model: its BERT
                model.gradient_checkpointing_enable = lambda **kw: enable_checkpointing(model.TextBertBase[0])""" \
        if checkpointable else ""
    path = folder / filename
    path.write_text(textwrap.dedent(f"""
        import json
        from jobs.modeling import build_model, enable_checkpointing, make_batch
        SPEC = json.load(open({str(folder / 'spec.json')!r}))
        def build(attention="sdpa"):
            model = build_model(SPEC, attention){hook}
            return model
        def batch(b, s):
            return make_batch(SPEC, b, s)
    """))
    return str(path)
