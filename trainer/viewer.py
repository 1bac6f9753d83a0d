"""`perceptrl view RUN`: one self-contained HTML page to browse a run.

The page (``trainer/view_page/``: page.html, view.css, view.js, no external resource) embeds
the run's data as one JSON document: the metric curves (``metrics.jsonl``, thinned to at most
`MAX_POINTS` points a metric), the rollout records (trainer/records.py) and the doctor's
findings (trainer/doctor.py). It opens from disk in any browser; ``--serve`` also serves it on
localhost. Views: groups (samples side by side, tokens coloured by advantage, reward components,
episode turns, trees), episodes (a VLA episode's frames as a video with its reward and value
curves), metrics (curves) and the doctor's findings. The page renders one page of groups at a
time and builds text with DOM text nodes only: a model's output is shown, never run.
"""

from __future__ import annotations

import http.server
import json
import math
import threading
from importlib import resources
from pathlib import Path

from ..errors import ConfigError, creating
from .doctor import diagnose, with_examples
from .metrics import read_metrics
from .records import read_records

MAX_POINTS = 2000
"""points kept per metric curve (evenly spaced steps, the last one always)"""


def page_data(run_dir: Path) -> dict:
    """What the page shows, as one JSON-able dict (see the module docstring)."""
    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    records = read_records(run_dir)
    findings = [
        {"name": f.name, "severity": f.severity, "steps": list(f.steps), "evidence": f.evidence,
         "why": f.why, "fix": f.fix, "keys": list(f.keys), "example": f.example}
        for f in with_examples(diagnose(rows) if rows else [], records)
    ]  # fmt: skip
    return {
        "run": run_dir.name,
        "metrics": metric_series(rows),
        "records": records,
        "findings": findings,
    }


def metric_series(rows: list[dict]) -> dict:
    """{"steps": [...], "series": {key: [value or None per step]}}: the last row of each step
    (a resumed run re-logs its checkpoint's step), thinned to `MAX_POINTS` steps."""
    by_step: dict[int, dict] = {}
    for r in rows:
        if isinstance(r.get("step"), int):
            by_step.setdefault(r["step"], {}).update(r)
    steps = sorted(by_step)
    if len(steps) > MAX_POINTS:
        stride = math.ceil(len(steps) / MAX_POINTS)
        steps = steps[::stride] + ([steps[-1]] if (len(steps) - 1) % stride else [])
    keys = sorted({k for s in steps for k, v in by_step[s].items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)})  # fmt: skip
    series = {k: [_finite(by_step[s].get(k)) for s in steps] for k in keys}
    return {
        "steps": steps,
        "series": {k: v for k, v in series.items() if any(x is not None for x in v)},
    }


def _finite(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def render(data: dict) -> str:
    """The page's HTML with ``data`` embedded."""
    page = resources.files(__package__).joinpath("view_page")
    html = page.joinpath("page.html").read_text(encoding="utf-8")
    data = json.loads(json.dumps(data), parse_constant=lambda _: None)  # NaN -> null (JSON)
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")  # stays in its <script>
    return (
        html.replace("/*CSS*/", page.joinpath("view.css").read_text(encoding="utf-8"))
        .replace("/*JS*/", page.joinpath("view.js").read_text(encoding="utf-8"))
        .replace("{{TITLE}}", _escape(f"perceptrl view: {data['run']}"))
        .replace("{{DATA}}", blob)
    )


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_view(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the page of ``run_dir`` to ``out`` (default ``RUN/view.html``); returns its path.

    Raises:
        ConfigError: ``run_dir`` is not a run directory (neither metrics nor records there).
    """
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file() and not (run_dir / "rollouts").is_dir():
        raise ConfigError(
            f"perceptrl view {run_dir}: no metrics.jsonl or rollouts/ there; give a run "
            "directory (the --run-dir of perceptrl train)"
        )
    out = Path(out) if out else run_dir / "view.html"
    with creating(out.parent):
        out.write_text(render(page_data(run_dir)), encoding="utf-8")
    return out


def serve(page: Path, port: int = 0) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve ``page``'s directory on localhost (port 0: a free one) in a background thread;
    returns the server (``shutdown()`` stops it) and the page's URL."""
    handler = lambda *a, **k: _Quiet(*a, directory=str(page.parent), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/{page.name}"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002  (the base class's name)
        pass
