"""/metrics exposes the serving and speculation series in Prometheus text, and they move with traffic."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fastapi.testclient import TestClient

from medusa.decoding.engine import EngineConfig
from medusa.decoding.server import build_app

EXPECTED = ["medusa:request_success_total", "medusa:num_requests_running", "medusa:num_requests_waiting",
            "medusa:kv_cache_usage_perc", "medusa:time_to_first_token_seconds_count",
            "medusa:inter_token_latency_seconds_count", "medusa:prompt_tokens_total", "medusa:generation_tokens_total",
            "medusa:spec_decode_num_drafts_total", "medusa:spec_decode_num_draft_tokens_total",
            "medusa:spec_decode_num_accepted_tokens_total", "medusa:spec_decode_num_accepted_tokens_from_lookup_total",
            "medusa:spec_decode_mean_accepted_length"]


def scrape(client) -> dict[tuple[str, tuple], float]:
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(resp.text) for s in family.samples}


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_series_present_without_traffic(tiny_model):
    app = build_app(tiny_model, "tiny", engine_config=EngineConfig(num_blocks=64))
    with TestClient(app) as client:
        names = {name for name, _ in scrape(client)}
    missing = [n for n in EXPECTED if n not in names and n != "medusa:request_success_total"]
    assert not missing


@pytest.mark.slow
def test_counters_move_with_requests(real_server, real_model):
    url, _ = real_server
    messages = [{"role": "user", "content": "A baker makes 24 muffins and sells them in boxes of 4. How many boxes?"}]
    with httpx.Client(base_url=url, timeout=120) as client:
        before = scrape(client)
        resp = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 16, "temperature": 0})
        usage = resp.json()["usage"]
        plain = client.post("/v1/completions", json={"prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0,
                                                     "speculative": False})
        after = scrape(client)
    assert resp.status_code == plain.status_code == 200
    assert {n for n, _ in after} >= set(EXPECTED)
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    reason = resp.json()["choices"][0]["finish_reason"]
    finished = value(delta, "medusa:request_success_total", finished_reason=reason)
    assert finished >= 1 and sum(v for (n, _), v in delta.items() if n == "medusa:request_success_total") == 2
    assert value(delta, "medusa:prompt_tokens_total") == usage["prompt_tokens"] + len(real_model.encode("1, 2, 3,"))
    assert value(delta, "medusa:generation_tokens_total") == usage["completion_tokens"] + 4
    assert value(delta, "medusa:time_to_first_token_seconds_count") == 2
    assert value(delta, "medusa:inter_token_latency_seconds_count") == usage["completion_tokens"] - 1 + 3
    # speculation: only the speculative request counts. After the prefill's token, each step emits
    # 1 + its accepted drafts (the last step may be cut short by max_tokens)
    drafts = value(delta, "medusa:spec_decode_num_drafts_total")
    accepted = value(delta, "medusa:spec_decode_num_accepted_tokens_total")
    # (plain steps, where the policy runs them, draft nothing and count no draft)
    assert 1 <= drafts <= usage["completion_tokens"] - 1
    assert value(delta, "medusa:spec_decode_num_draft_tokens_total") >= drafts
    per_depth = {dict(labels)["depth"]: v for (n, labels), v in delta.items()
                 if n == "medusa:spec_decode_num_accepted_tokens_per_depth_total"}
    assert sum(per_depth.values()) == accepted and accepted > 0 and per_depth["1"] >= per_depth.get("2", 0)
    assert value(after, "medusa:num_requests_running") == 0 and value(after, "medusa:kv_cache_usage_perc") == 0
