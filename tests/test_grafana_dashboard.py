"""docs/grafana-dashboard.json: it parses, and every query names a metric (and tags) the code defines."""

from __future__ import annotations

import json
import re
from pathlib import Path

from rayslice.cluster.metrics import METRICS

DOCS = Path(__file__).resolve().parents[1] / "docs"
#: What Ray's Prometheus endpoint adds to each metric type's name (Ray prefixes every name with `ray_`).
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}
EXPORTED = {f"ray_{name}{suffix}": name for name, (kind, _, _) in METRICS.items() for suffix in SUFFIXES[kind]}
#: The label the scrape adds to every Ray metric of one Ray cluster (KubeRay's pod label `ray.io/cluster`, as
#: docs/metrics.md's PodMonitoring and scrape configs set it): not a tag of rayslice's metrics.
CLUSTER_LABEL = "ray_io_cluster"


def dashboard() -> dict:
    return json.loads((DOCS / "grafana-dashboard.json").read_text())


def queries() -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in dashboard()["panels"] for target in panel["targets"]]


def test_the_dashboard_parses_and_its_panels_are_well_formed():
    board = dashboard()
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in board["panels"]:
        assert panel["title"] and panel["targets"] and {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "cluster", "kind"]


def test_every_query_names_metrics_and_tags_the_code_defines():
    for title, expr in queries():
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), (title, expr)
        names = set(re.findall(r"\bray_rayslice_\w+", expr))
        assert names, f"{title}: names no rayslice metric: {expr}"
        unknown = names - set(EXPORTED)
        assert not unknown, f"{title}: {sorted(unknown)} are not metrics rayslice defines ({sorted(EXPORTED)})"
        tags = {tag for name in names for tag in METRICS[EXPORTED[name]][2]}
        used = {label.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for label in group.split(",")}
        used |= set(re.findall(r"(\w+)=~?\"", expr))
        used.discard(CLUSTER_LABEL)
        assert used - {"le"} <= tags, f"{title}: tags {sorted(used - {'le'} - tags)} are not the metric's ({tags})"
        if "le" in used:
            assert all(name.endswith("_bucket") for name in names if "le" in expr), (title, expr)


def test_every_metric_has_a_panel_and_a_line_in_the_metrics_page():
    shown = {EXPORTED[name] for _, expr in queries() for name in re.findall(r"\bray_rayslice_\w+", expr)}
    assert shown == set(METRICS)
    page = (DOCS / "metrics.md").read_text()
    for name in METRICS:
        assert f"ray_{name}" in page, f"docs/metrics.md does not list ray_{name}"


def test_every_query_and_the_kind_list_keep_to_the_chosen_clusters():
    """Issue 50: per-run clusters and several shared ones would be summed together without a cluster filter."""
    board = dashboard()
    [cluster] = [v for v in board["templating"]["list"] if v["name"] == "cluster"]
    assert cluster["query"]["query"] == f"label_values(ray_rayslice_steps_total, {CLUSTER_LABEL})"
    assert cluster["includeAll"] and cluster["allValue"] == ".*"  # also matches series without the label
    [kind] = [v for v in board["templating"]["list"] if v["name"] == "kind"]
    assert f'{CLUSTER_LABEL}=~"$cluster"' in kind["query"]["query"]
    for title, expr in queries():
        selectors = re.findall(r"ray_rayslice_\w+\{([^}]*)\}", expr)
        assert selectors and len(selectors) == len(re.findall(r"\bray_rayslice_\w+", expr)), (title, expr)
        assert all(f'{CLUSTER_LABEL}=~"$cluster"' in sel for sel in selectors), (title, expr)
