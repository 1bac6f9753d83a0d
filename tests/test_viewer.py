"""`perceptrl view` in a real headless browser (Chromium, driven by Playwright): pages of real
short runs (VLM tool episodes with guide rows, VLM trees, VLA pixel episodes) load without
console errors, show the recorded groups, filter them, render their images, trees and episode
videos; a page of thousands of samples stays fast. Chromium comes from the system's packages
(`make setup` installs Debian's ``chromium``); ``PERCEPTRL_CHROMIUM`` names another binary.

``PERCEPTRL_SCREENSHOTS=DIR`` also writes one screenshot per view into DIR (the docs' images:
``PERCEPTRL_SCREENSHOTS=docs/img .venv/bin/python -m pytest tests/test_viewer.py``)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from perceptrl.cli import main
from perceptrl.trainer.records import read_records
from perceptrl.trainer.viewer import metric_series, render, write_view

QUIET = ["log.progress=false", "log.tensorboard=false", "checkpoint.every=0",
         "train.eval_every=0", "log.rollouts_every=2", "log.rollouts_groups=2"]  # fmt: skip
VLM = ["data.n_train=12", "data.n_val=4", "rollout.prompts_per_step=2", "train.eval_samples=4",
       "algo.dynamic_sampling=false"]  # fmt: skip
RUNS = {
    "episodes": ["vlm_zoom", *VLM, "rollout.group_size=3", "rollout.guide=1", "train.steps=4"],
    "tree": ["vlm_clevr_tree", *VLM, "train.steps=1"],
    # two tokens hold no answer: every group scores 0 and every completion is cut
    "unreachable": [
        "vlm_clevr",
        *VLM,
        "rollout.group_size=4",
        "rollout.max_new_tokens=2",
        "rollout.reward={accuracy: 1.0}",
        "train.steps=3",
    ],
    "robot": ["vla_ppo_reach", "env.num_envs=4", "env.eval_episodes=2", "train.steps=2"],
}


def chromium() -> str:
    found = os.environ.get("PERCEPTRL_CHROMIUM") or next(
        (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
        None,
    )  # fmt: skip
    if not found:
        pytest.fail(
            "no Chromium: `make sysdeps` installs Debian's chromium (or set PERCEPTRL_CHROMIUM)"
        )
    return found


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, Path]:
    """The page of each of `RUNS`, trained here."""
    out = {}
    for name, args in RUNS.items():
        run = tmp_path_factory.mktemp(name) / "run"
        assert main(["train", args[0], *QUIET, *args[1:], "--run-dir", str(run)]) == 0
        assert main(["view", str(run)]) == 0
        out[name] = run / "view.html"
    return out


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[dev]'")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        yield b
        b.close()


class Page:
    """A page opened in the browser, with its console errors collected."""

    def __init__(self, browser, path: Path):
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(path.resolve().as_uri())
        self.page.wait_for_function("window.__viewReady === true")

    def count(self, selector: str = "#group-count") -> int:
        return int(self.page.get_attribute(selector, "data-count"))

    def choose(self, name: str, value: str) -> None:
        self.page.evaluate("window.__viewReady = false")
        self.page.select_option(f"select[name={name}]", value)
        self.page.wait_for_function("window.__viewReady === true")

    def tab(self, name: str) -> None:
        self.page.click(f"button[data-tab={name}]")

    def shot(self, name: str) -> None:
        where = os.environ.get("PERCEPTRL_SCREENSHOTS")
        if where:
            Path(where).mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(Path(where) / f"view_{name}.png"))

    def images_rendered(self, selector: str) -> tuple[int, int]:
        """(images matching ``selector``, those decoded with a size)"""
        return self.page.evaluate(
            f"""() => {{ const im = [...document.querySelectorAll({json.dumps(selector)})];
            return [im.length, im.filter((i) => i.complete && i.naturalWidth > 0).length]; }}"""
        )


def groups_of(page_path: Path) -> list[dict]:
    return [g for r in read_records(page_path.parent) for g in r["groups"]]


def alike(g: dict) -> bool:
    return len(g["rows"]) > 1 and len({r["reward"] for r in g["rows"]}) == 1


def test_tool_episodes_page(browser, pages):
    p = Page(browser, pages["episodes"])
    groups = groups_of(pages["episodes"])
    assert p.count() == len(groups) > 0
    shown, decoded = p.images_rendered("img")
    assert shown > 0 and decoded == shown
    obs, obs_decoded = p.images_rendered("img[alt=observation]")  # the guide rows' zoomed cells
    assert obs > 0 and obs_decoded == obs
    assert p.page.locator(".turn").count() > 0 and p.page.locator(".sample.guide").count() > 0
    assert p.page.locator("span.tok[style*=background]").count() > 0  # coloured by advantage
    p.shot("rollouts")
    p.choose("filter", "alike")
    assert p.count() == sum(alike(g) for g in groups)
    p.choose("filter", "mixed")
    assert p.count() == sum(not alike(g) for g in groups)
    p.choose("filter", "all")
    p.choose("step", str(read_records(pages["episodes"].parent)[-1]["step"]))
    assert p.count() == len(read_records(pages["episodes"].parent)[-1]["groups"])
    p.page.evaluate("window.__viewReady = false")
    p.page.fill("input[name=search]", groups[-1]["id"])
    p.page.press("input[name=search]", "Enter")
    p.page.wait_for_function("window.__viewReady === true")
    assert p.count() == 1
    assert p.errors == []


def test_metrics_and_doctor_of_a_run_that_cannot_learn(browser, pages):
    p = Page(browser, pages["unreachable"])
    groups = groups_of(pages["unreachable"])
    p.choose("filter", "alike")
    assert p.count() == len(groups) > 0
    p.choose("filter", "truncated")
    assert p.count() == len(groups)
    p.tab("metrics")
    assert p.count("#curve-count") > 0 and p.page.locator(".curve polyline").count() > 0
    p.shot("metrics")
    p.tab("doctor")
    names = p.page.locator(".finding.serious h3").all_text_contents()
    assert any(n.startswith("groups scored alike") for n in names), names
    assert any(n.startswith("completions hit the length limit") for n in names), names
    p.shot("doctor")
    assert p.errors == []


def test_tree_page(browser, pages):
    p = Page(browser, pages["tree"])
    groups = groups_of(pages["tree"])
    trees = p.page.locator("svg.tree-svg")
    assert trees.count() == len(groups) > 0
    for i, g in enumerate(groups):  # every node of the group's rows drawn once
        nodes = {n for r in g["rows"] for n in r["nodes"] if n}
        assert int(trees.nth(i).get_attribute("data-nodes")) == len(nodes)
        assert p.page.locator("svg.tree-svg").nth(i).locator("circle.node").count() == len(nodes)
    p.shot("tree")
    assert p.errors == []


def test_robot_episodes_page(browser, pages):
    p = Page(browser, pages["robot"])
    assert p.count() == len(groups_of(pages["robot"])) > 0
    shown, decoded = p.images_rendered("img.frame")
    assert shown > 0 and decoded == shown
    frame = p.page.locator("img.frame").first
    first = frame.get_attribute("src")
    p.page.locator(".video button").first.click()  # play
    p.page.wait_for_function(
        "(s) => document.querySelector('img.frame').getAttribute('src') !== s", arg=first
    )
    assert p.page.locator(".episode svg.plot polyline").count() > 0  # reward / value curves
    p.shot("episodes")
    p.tab("metrics")
    assert p.count("#curve-count") > 0
    assert p.errors == []


def test_a_page_of_thousands_of_samples_stays_fast(browser, tmp_path):
    """50 recorded steps x 8 groups x 8 samples of 120 tokens: the page opens and filters in
    well under the time a person waits for it."""
    (tmp_path / "rollouts").mkdir()
    for step in range(1, 51):
        groups = [{"group": g, "prompt": f"question {step}-{g}", "id": f"s{step}-{g}", "rows": [
            {"row": r, "reward": float((r + g) % 2), "length": 120, "text": "x" * 200,
             "tokens": [f"t{i}" for i in range(120)], "adv": [0.1 * (r - 4)] * 120,
             "logp": [-0.5] * 120, "components": {"accuracy": float((r + g) % 2)}}
            for r in range(8)]} for g in range(8)]  # fmt: skip
        data = json.dumps({"step": step, "groups": groups}).encode()
        (tmp_path / "rollouts" / f"step_{step:06d}.json.gz").write_bytes(gzip.compress(data))
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward/mean": s / 5000}) + "\n" for s in range(1, 5001))
    )
    page = write_view(tmp_path)
    t0 = time.perf_counter()
    p = Page(browser, page)
    opened = time.perf_counter() - t0
    assert p.count() == 400  # 3,200 samples
    t0 = time.perf_counter()
    p.choose("filter", "mixed")
    filtered = time.perf_counter() - t0
    assert p.count() == 400 and opened < 5 and filtered < 2, (opened, filtered)
    assert p.errors == []


def test_model_output_cannot_end_the_data_script():
    """A completion holding ``</script>`` stays text: the embedded JSON escapes it."""
    data = {"run": "r", "metrics": {"steps": [], "series": {}}, "findings": [],
            "records": [{"step": 1, "groups": [{"group": 0, "rows": [
                {"reward": 0, "length": 1, "text": "</script><script>alert(1)</script>"}]}]}]}  # fmt: skip
    html = render(data)
    start = html.index('id="run-data">') + len('id="run-data">')
    blob = html[start : html.index("</script>", start)]
    assert json.loads(blob.replace("<\\/", "</")) == data


def test_metric_series_keeps_the_last_row_of_a_step_and_thins_long_runs():
    rows = [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}, {"step": 2, "a": 5.0, "b": None},
            {"step": 3, "a": float("nan")}]  # fmt: skip
    assert metric_series(rows) == {"steps": [1, 2, 3], "series": {"a": [1.0, 5.0, None]}}
    long = metric_series([{"step": s, "a": float(s)} for s in range(1, 10_001)])
    assert len(long["steps"]) <= 2001 and long["steps"][0] == 1 and long["steps"][-1] == 10_000


def test_view_of_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert main(["view", str(tmp_path)]) == 2
    assert "no metrics.jsonl or rollouts/" in capsys.readouterr().err


def test_not_a_number_in_older_records_becomes_null():
    data = {"run": "r", "metrics": {"steps": [], "series": {}}, "findings": [],
            "records": [{"step": 1, "groups": [{"group": 0, "rows": [
                {"reward": float("nan"), "length": 1}]}]}]}  # fmt: skip
    html = render(data)
    start = html.index('id="run-data">') + len('id="run-data">')
    blob = html[start : html.index("</script>", start)]
    assert (
        "NaN" not in blob
        and json.loads(blob)["records"][0]["groups"][0]["rows"][0]["reward"] is None
    )
