"""`planner report`: a search's results as one HTML page with plotly.js beside it, plus PNGs (printing only)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from planner.cli.common import console, handles_errors


def register(app: typer.Typer) -> None:
    @app.command("report")
    @handles_errors
    def report(
        study: Annotated[str, typer.Option("--study", help="Search (study) name, as given to `planner search`.")],
        storage: Annotated[str | None, typer.Option(
            help="Journal file or Optuna RDB URL (default results/<study>/journal.log).")] = None,
        top: Annotated[int, typer.Option(min=1, help="Candidates in the memory breakdown.")] = 5,
        results_dir: Annotated[Path, typer.Option(help="Where results/<study>/ lives.")] = Path("results"),
        probes: Annotated[Path | None, typer.Option(
            help="Probe results for predicted vs measured (default results/probes.parquet).")] = None,
        out_dir: Annotated[Path | None, typer.Option(
            "--out-dir", help="Where report.html and the PNGs go (default results/<study>/).")] = None,
    ) -> None:
        """Memory breakdowns of the top candidates, throughput vs memory with the OOM line, Pareto fronts,
        Optuna history and importances, predicted vs measured: results/<study>/report.html + PNGs."""
        from planner.errors import PlannerError
        from planner.memory.runtime import check_calibration
        from planner.prices import load_cache
        from planner.report.html import write_report

        load_cache()  # a corrupt prices cache or calibration fails here, not as figures quietly left out
        check_calibration()
        if probes is not None and not probes.is_file():  # the default may be absent; a named file may not
            raise PlannerError("--probes", str(probes), "an existing probes table (results/probes.parquet, "
                                                        "written by `planner probe collect`)")
        rep = write_report(study, storage, top=top, results_dir=results_dir, probes=probes, out_dir=out_dir)
        for note in rep.notes:
            console.print(f"[dim]note: {note}[/]", highlight=False)
        console.print(f"report written to {rep.path} ({len(rep.pngs)} PNGs next to it)", highlight=False,
                      soft_wrap=True)
