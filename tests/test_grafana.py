"""docs/grafana/omni_async.json: a well-formed Grafana dashboard whose every query names a series
(and labels) that a running service really exports on ``/metrics``."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(60)

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "omni_async.json"
ADDED_BY_PROMETHEUS = {"instance", "job"}
"""Target labels Prometheus adds at scrape time (not in the exposition)."""
_SELECTOR = re.compile(r"\b(omni_async_\w+)\s*(?:\{([^}]*)\})?")
_MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def queries(data: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and query variables."""
    exprs = [target["expr"] for panel in data["panels"] for target in panel.get("targets", [])]
    exprs += [var["definition"] for var in data["templating"]["list"] if var["type"] == "query"]
    return exprs


def test_dashboard_is_a_grafana_model() -> None:
    data = dashboard()
    assert data["title"] and data["uid"] and isinstance(data["schemaVersion"], int)
    ids = [panel["id"] for panel in data["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {var["name"]: var for var in data["templating"]["list"]}
    assert {"datasource", "instance", "peer"} <= set(variables)
    for panel in data["panels"]:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel["datasource"]["uid"] == "${datasource}"
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(refs) == len(set(refs))
        for target in panel["targets"]:
            assert 'instance=~"$instance"' in target["expr"], (panel["title"], target["expr"])
    titles = " ".join(panel["title"].lower() for panel in data["panels"])
    for subject in ("bytes/s", "latency p50 / p99", "failed, by reason", "peers joined / lost", "in flight"):
        assert subject in titles
    exprs = " ".join(queries(data))
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_every_query_names_an_exported_metric_and_its_labels(make_service: Any) -> None:
    port = free_port()
    a = await make_service("ga", agent={"metrics_port": port})
    b = await make_service("gb")
    await a.agent.connect(b.control_address)
    await asyncio.wait_for(b.agent.wait_for_peer("ga"), 5)
    await asyncio.wait_for(a.agent.write_blocks("gb", [0, 1], [2, 3]), 5)
    await asyncio.wait_for(b.agent.write_blocks("ga", [0], [1]), 5)  # so "ga" answers one too
    a.adapter("stage")  # streams are reported per adapter stage
    url = f"http://127.0.0.1:{port}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())

    exported: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)

    checked = set()
    variable_queries = {var["definition"] for var in dashboard()["templating"]["list"] if var["type"] == "query"}
    for expr in queries(dashboard()):
        names = _SELECTOR.findall(expr)
        assert names, f"query names no omni_async metric: {expr}"
        known_labels = set(ADDED_BY_PROMETHEUS)
        for name, matchers in names:
            assert name in exported, f"{name} (in {expr!r}) is not exported; exported: {sorted(exported)}"
            labels = exported[name]
            known_labels |= labels
            unknown = set(_MATCHER.findall(matchers)) - labels - ADDED_BY_PROMETHEUS
            assert not unknown, f"{name} has no label {sorted(unknown)} (in {expr!r})"
            if "peer" in labels and expr not in variable_queries:
                assert 'peer=~"$peer"' in matchers, f"{name} is per peer: filter it by $peer in {expr!r}"
            checked.add(name)
        for group in _BY.findall(expr):
            unknown = {label.strip() for label in group.split(",") if label.strip()} - known_labels
            assert not unknown, f"grouping by unknown labels {sorted(unknown)} in {expr!r}"
    # the dashboard covers every omni_async family the service exports
    families = {re.sub(r"_(bucket|sum|count|total|created)$", "", name) for name in exported
                if name.startswith("omni_async_")}
    covered = {re.sub(r"_(bucket|sum|count|total|created)$", "", name) for name in checked}
    assert families <= covered, f"not on the dashboard: {sorted(families - covered)}"
