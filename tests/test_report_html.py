"""The HTML report: from small histories as the benches save them (tests/histories.py), the page embeds each point's
runs per machine in commit order and links each machine's tables and plots; in the browser tier, the page of every
committed history opens in headless Chromium from disk, fast and without console errors, and picking a machine,
a point kind and a point shows that point's commits. Its screenshot goes where REPORT_HTML_SCREENSHOT says."""

import json
import os
import pathlib
import re
import shutil
import time

import pytest

from histories import allreduce_measured, config, entry, rate, save_run
from systems.bench.schema import AllReducePoint, ModelMeasured, ModelPoint
from systems.precision import PRECISIONS

pytest.importorskip("bokeh", reason="the HTML report draws with bokeh: pip install -e '.[report]'")
from systems.report.html import main, write_page  # noqa: E402 (after the skip: it imports bokeh)

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOAD_LIMIT_MS = 2000  # the target: the page of every committed history drawn within 2 s of opening it
H100 = {"machine": "x86_64", "systems_lab": {"gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 1, "torch": "2.11.0"}}
H200X2 = {"machine": "x86_64", "systems_lab": {"gpu": "NVIDIA H200", "gpu_count": 2, "torch": "2.11.0"}}
CPU = {"machine": "x86_64", "cpu": {"brand_raw": "AMD EPYC"}}


def model(phase: str, seconds: float, context: int = 128) -> dict:
    point = ModelPoint("small", "2025", 4, context, PRECISIONS["fp32"], "sdpa", "eager", phase)
    return entry(point, ModelMeasured(1, None, rate(100.0), 1000.0, config("small", context)), seconds)


def allreduce(seconds: float, size_mb: float = 1.0) -> dict:
    nbytes = int(size_mb * 2**20)
    return entry(AllReducePoint("nccl", 2, size_mb), allreduce_measured(nbytes, seconds, seconds), seconds)


def save(storage, number, benchmarks, machine_info, commit, commit_time, run_time, folder="Linux-CPython-3.12-64bit",
         **fields):
    return save_run(storage, number, benchmarks, machine=folder, machine_info=machine_info,
                    commit_info={"id": commit + "0" * 33, "time": commit_time, "dirty": fields.pop("dirty", False)},
                    datetime=run_time, **fields)


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> pathlib.Path:
    """Runs on three machines. Run 4 is numbered last but its commit is the oldest; run 5 stopped early."""
    storage = tmp_path_factory.mktemp("storage")
    save(storage, 1, [model("forward", 0.010), model("backward", 0.020), model("forward", 0.02, 256)], H100,
         "aaaa111", "2026-01-02T10:00:00+00:00", "2026-01-02T11:00:00")
    save(storage, 2, [model("forward", 0.011)], H100, "bbbb222", "2026-01-03T10:00:00+00:00", "2026-01-03T11:00:00",
         dirty=True)
    save(storage, 3, [model("forward", 0.012)], H100, "bbbb222", "2026-01-03T10:00:00+00:00", "2026-01-03T12:00:00")
    save(storage, 4, [model("forward", 0.009)], H100, "0000000", "2026-01-01T10:00:00+00:00", "2026-01-04T11:00:00")
    save(storage, 5, [model("forward", 1.0)], H100, "eeee555", "2026-01-05T10:00:00+00:00", "2026-01-05T11:00:00",
         systems_lab_complete=False)
    save(storage, 6, [allreduce(4e-5), allreduce(1e-3, 100.0)], H200X2, "aaaa111", "2026-01-02T10:00:00+00:00",
         "2026-01-02T13:00:00")
    save(storage, 1, [model("forward", 0.5)], CPU, "cccc333", "2026-01-04T10:00:00+00:00", "2026-01-04T12:00:00",
         folder="Linux-CPython-3.11-64bit")
    return storage


@pytest.fixture(scope="module")
def page(storage, tmp_path_factory) -> pathlib.Path:
    return write_page(storage, tmp_path_factory.mktemp("report"))


def embedded(page: pathlib.Path) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="histories">(.*?)</script>',
                                page.read_text(), re.S).group(1))


def test_the_page_holds_each_point_over_the_complete_runs_of_each_machine_in_commit_order(page):
    view = embedded(page)
    assert list(view) == ["CPU", "1 x H100", "2 x H200"]
    assert {kind: list(points) for kind, points in view["1 x H100"].items()} == {"model": [
        "test_model[small-2025-b4-ctx128-fp32-sdpa-eager-forward]",  # the longest history first
        "test_model[small-2025-b4-ctx128-fp32-sdpa-eager-backward]",
        "test_model[small-2025-b4-ctx256-fp32-sdpa-eager-forward]"]}
    forward = view["1 x H100"]["model"]["test_model[small-2025-b4-ctx128-fp32-sdpa-eager-forward]"]
    # By commit time, not by number; the partial run 5 is left out; runs of one commit by their own time.
    assert [(run["run"][:4], run["commit"]) for run in forward] == [
        ("0004", "0000000"), ("0001", "aaaa111"), ("0002", "bbbb222"), ("0003", "bbbb222")]
    assert [run["median_ms"] for run in forward] == pytest.approx([9.0, 10.0, 11.0, 12.0])
    assert [run["changes"] for run in forward] == ["", "", "uncommitted changes", ""]
    assert [run["commit"] for run in view["2 x H200"]["allreduce"]["test_allreduce[nccl-2ranks-1MiB]"]] == ["aaaa111"]
    assert list(view["CPU"]["model"]) == ["test_model[small-2025-b4-ctx128-fp32-sdpa-eager-forward]"]
    # The machine of the newest commit's run is picked first.
    assert re.search(r'<option value="CPU" selected>CPU \(1 runs\)</option>', page.read_text())


def test_each_machine_has_its_tables_and_plots_beside_the_page(page):
    text = page.read_text()
    sections = dict(re.findall(r'<section data-machine="([^"]+)" hidden>(.*?)</section>', text, re.S))
    assert list(sections) == ["CPU", "1 x H100", "2 x H200"]
    assert "Model: time per call" in sections["1 x H100"] and "Model: time per call" not in sections["2 x H200"]
    assert "<table>" in sections["2 x H200"]
    images = re.findall(r'<img src="([^"]+)"', text)
    assert images and all((page.parent / image).is_file() for image in images)
    assert {image.split("/")[0] for image in images} >= {"1-x-H100", "2-x-H200"}


def test_a_missing_storage_is_a_one_line_error(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "out"), "--storage", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err == f"report: error: no benchmark history at {tmp_path / 'none'}\n"


def without_median(path: pathlib.Path) -> None:
    history = json.loads(path.read_text())
    del history["benchmarks"][0]["stats"]["median"]
    path.write_text(json.dumps(history))


@pytest.mark.parametrize("spoil, why", [(lambda path: path.write_text("{"), "is not a pytest-benchmark history"),
                                        (without_median, "its stats lack")])
def test_a_malformed_history_is_named(tmp_path, capsys, spoil, why):
    bad = save_run(tmp_path / "storage", 1, [model("forward", 0.01)])
    spoil(bad)
    assert main(["--out", str(tmp_path / "out"), "--storage", str(tmp_path / "storage"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"report: error: {bad}") and why in err and err.count("\n") == 1


def committed_commits(gpu: str, count: int, kind: str) -> dict[str, set[str]]:
    """{benchmark name: the commits of the complete committed runs on that machine that hold it}, read from the
    histories directly, apart from the code under test."""
    commits: dict[str, set[str]] = {}
    for path in (ROOT / ".benchmarks").glob("*/*.json"):
        history = json.loads(path.read_text())
        lab = history["machine_info"].get("systems_lab") or {}
        if (lab.get("gpu"), lab.get("gpu_count")) != (gpu, count) or history.get("systems_lab_complete") is False:
            continue
        for bench in history["benchmarks"]:
            if bench["extra_info"].get("point", {}).get("kind") == kind:
                commits.setdefault(bench["name"], set()).add(str(history["commit_info"].get("id", "unknown"))[:7])
    return commits


@pytest.fixture
def chromium():
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("needs Chromium and its driver: apt-get install chromium chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium: pip install -e '.[test]'")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    # As root (CI) Chromium runs only without its sandbox; /dev/shm may be small in a container.
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=webdriver.ChromeService(shutil.which("chromedriver")), options=options)
    yield driver
    driver.quit()


@pytest.mark.browser
def test_the_page_of_every_committed_history_opens_in_chromium(chromium, tmp_path):
    from selenium.webdriver.support.ui import Select, WebDriverWait

    # Plots left out: drawing every machine's takes a minute, and the page links them only.
    page = write_page(ROOT / ".benchmarks", tmp_path / "report", plots=False)
    chromium.get(page.as_uri())
    ready = WebDriverWait(chromium, 30).until(
        lambda driver: driver.execute_script("return document.body.dataset.ready"))
    assert int(ready) < LOAD_LIMIT_MS, f"the page was drawn {ready} ms after it was opened"

    Select(chromium.find_element("id", "machine")).select_by_value("1 x H100")
    Select(chromium.find_element("id", "kind")).select_by_value("attention")
    commits = committed_commits("NVIDIA H100 80GB HBM3", 1, "attention")
    name = max(sorted(commits), key=lambda name: len(commits[name]))
    Select(chromium.find_element("id", "point")).select_by_value(name)
    caption = chromium.find_element("id", "history-caption").text
    assert caption.startswith(f"{name} on 1 x H100: ") and caption.endswith(f" at {len(commits[name])} commits")
    shown = chromium.execute_script('return Bokeh.documents[0].get_model_by_name("history").x_range.factors')
    assert set(shown) == commits[name] and len(shown) == len(commits[name]) > 5
    time.sleep(0.5)  # the canvas is drawn on the next frames

    errors = [entry for entry in chromium.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors
    screenshot = pathlib.Path(os.environ.get("REPORT_HTML_SCREENSHOT", tmp_path / "report-html.png"))
    chromium.save_screenshot(str(screenshot))
    print(f"page drawn {ready} ms after opening; screenshot: {screenshot}")
