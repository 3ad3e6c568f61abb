"""The default's report opened as a reader opens it: headless Chromium at 1280 px (Debian's `chromium`)."""

import json
import re
import shutil
import subprocess

import pytest

from snaketrl import paths

BROWSER = next((shutil.which(name) for name in ("chromium", "chromium-browser") if shutil.which(name)), None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# Runs in the page once it has loaded (images decoded), writes what it measured into the DOM for --dump-dom.
PROBE = r"""
<script>
window.addEventListener("load", () => {
  const out = {width: window.innerWidth, scrollWidth: document.documentElement.scrollWidth};
  try { probe(out); } catch (err) { out.error = String(err); }
  const pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
function probe(out) {
  const e = /\d(\.\d+)?[eE][+-]?\d/;
  out.eCells = [...document.querySelectorAll("table:not(.side) td, table:not(.side) tbody th")]
    .map(c => c.textContent).filter(t => e.test(t));
  out.ePre = [...document.querySelectorAll("pre")].flatMap(p => p.textContent.match(/[:\[,]\s*-?\d+(\.\d+)?[eE][+-]?\d+/g) || []);
  out.images = document.images.length;
  out.undecoded = [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt);
  const board = document.querySelector("table.leaderboard");
  out.boardWidth = Math.ceil(board.getBoundingClientRect().width);
  const th = [...board.tHead.rows[0].cells].find(c => c.classList.contains("float") && !c.classList.contains("sec"));
  const values = () => [...board.tBodies[0].rows].map(r => r.cells[th.cellIndex].dataset.sort)
                                                 .filter(v => v !== "").map(Number);
  out.column = th.textContent;
  out.before = values();
  th.click(); out.ascending = values();
  th.click(); out.descending = values();
}
</script>
"""


def open_in_chromium(html_file, tmp_path, width=1280, height=900) -> dict:
    page = tmp_path / "probed.html"
    page.write_text(html_file.read_text().replace("</body>", PROBE + "</body>"))
    proc = subprocess.run([BROWSER, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                           f"--window-size={width},{height}", "--virtual-time-budget=30000", "--dump-dom",
                           page.as_uri()], capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="probe">(.*?)</pre>', proc.stdout, re.S)
    assert found, f"chromium wrote no probe result (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<")
                      .replace("&gt;", ">"))


@pytest.mark.slow
@pytest.mark.skipif(BROWSER is None, reason="needs Debian's chromium (apt-get install chromium); .ci/run installs it")
def test_default_report_fits_1280px_decodes_every_image_sorts_and_has_no_e_notation(workflow_run, tmp_path):
    seen = open_in_chromium(workflow_run / paths.report(), tmp_path)
    assert "error" not in seen, seen
    assert seen["width"] == 1280 and seen["scrollWidth"] <= 1280, seen
    assert seen["boardWidth"] <= 1280 - 32  # the leaderboard's default view, inside the page's margins
    assert seen["images"] >= 25 and seen["undecoded"] == []  # 10 runs x 2, overlays, the first figure, ...
    assert len(seen["before"]) >= 10 and seen["ascending"] == sorted(seen["before"])
    assert seen["descending"] == sorted(seen["before"], reverse=True) != seen["ascending"], seen["column"]
    assert seen["eCells"] == [] and seen["ePre"] == []


@pytest.mark.slow
def test_every_run_recorded_its_cost_per_step(workflow_run):
    """FLOPs at every optimizer step, aligned with trainer_state's steps; forward-only FLOPs exactly where a
    trainer runs forwards without gradients (generation, reference, reward and value models)."""
    for metrics_file in sorted(workflow_run.glob(paths.run_file("*", "metrics.json"))):
        run = metrics_file.parent.name
        metrics = json.loads(metrics_file.read_text())
        state = json.loads((metrics_file.parent / "trainer_state.json").read_text())
        curve = metrics["cost_by_step"]
        assert curve["step"] == list(range(1, state["global_step"] + 1)), run
        assert curve["flops"][-1] == metrics["flops"] == metrics["flops_trained"] + metrics["flops_forward_only"]
        assert all(b > a for a, b in zip(curve["flops"], curve["flops"][1:])), run
        assert 0 < metrics["train_seconds"] and metrics["peak_rss_bytes"] > 200 * 2**20, run
        trainer = run.split("-")[0]
        weights = metrics["flop_weights"]["policy"]
        # A trained token costs at least 4·N + 2·N_trainable (its forward, backward and LoRA's weight gradients).
        assert metrics["flops_trained"] >= (4 * weights["weights"] + 2 * weights["trainable"]) * metrics["processed_tokens"]
        assert (metrics["flops_forward_only"] > 0) == (trainer in ("dpo", "grpo", "ppo")), run
        if trainer == "ppo":
            assert set(metrics["flop_weights"]) == {"policy", "value_model", "reward_model"}
