"""docs/deploy/ manifests: every document validates against its schema (built-in kinds through
kubernetes-validate's bundled Kubernetes schemas, strict; the Gateway API and Inference Extension
CRDs through their vendored openAPIV3Schema in tests/fixtures/k8s_schemas), the objects refer to
each other consistently, and the metrics docs/deploy.md says the endpoint picker reads are ones
memra exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "docs" / "deploy"
SCHEMAS = Path(__file__).resolve().parent / "fixtures" / "k8s_schemas"
K8S_VERSION = "1.33"


def _docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        out += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def _crd_schemas() -> dict[tuple[str, str], dict]:
    out = {}
    for p in SCHEMAS.glob("*.json"):
        s = json.loads(p.read_text())
        out[(s["apiVersion"], s["kind"])] = s["schema"]
    return out


def test_manifests_validate_against_their_schemas():
    kv = pytest.importorskip("kubernetes_validate")
    import jsonschema

    crds = _crd_schemas()
    kinds = set()
    for _name, doc in _docs():
        kinds.add(doc["kind"])
        key = (doc["apiVersion"], doc["kind"])
        if key in crds:
            jsonschema.Draft202012Validator(crds[key]).validate(doc)
        else:
            kv.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError / SchemaNotFoundError
    assert {"Deployment", "Service", "InferencePool", "HTTPRoute", "Gateway"} <= kinds


def test_schemas_catch_a_broken_manifest():
    import jsonschema

    kv = pytest.importorskip("kubernetes_validate")
    pool = next(d for _, d in _docs() if d["kind"] == "InferencePool")
    bad = json.loads(json.dumps(pool))
    del bad["spec"]["targetPorts"]
    with pytest.raises(jsonschema.ValidationError, match="targetPorts"):
        jsonschema.Draft202012Validator(_crd_schemas()[("inference.networking.k8s.io/v1", "InferencePool")]).validate(bad)
    dep = json.loads(json.dumps(next(d for _, d in _docs() if d["kind"] == "Deployment")))
    dep["spec"]["replicas"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, K8S_VERSION, strict=True)


def test_objects_refer_to_each_other():
    docs = [d for _, d in _docs()]
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    pool = by[("InferencePool", "memra-qwen3")]
    memra = by[("Deployment", "memra-qwen3")]
    labels = memra["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["containerPort"] for c in memra["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= ports
    cmd = memra["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[:2] == ["memra", "serve"] and cmd[cmd.index("--port") + 1] == "8000"
    epp_svc = by[("Service", pool["spec"]["endpointPickerRef"]["name"])]
    assert epp_svc["spec"]["ports"][0]["port"] == pool["spec"]["endpointPickerRef"]["port"]["number"]
    epp = by[("Deployment", epp_svc["spec"]["selector"]["app"])]
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == "memra-qwen3"
    route = by[("HTTPRoute", "memra-qwen3")]
    refs = [b for r in route["spec"]["rules"] for b in r["backendRefs"]]
    assert {(b["kind"], b["name"]) for b in refs} == {("InferencePool", "memra-qwen3")}
    gw = route["spec"]["parentRefs"][0]
    assert any(ln["name"] == gw["sectionName"] for ln in by[("Gateway", gw["name"])]["spec"]["listeners"])


def test_metrics_the_picker_reads_are_exported():
    text = (ROOT / "docs" / "deploy.md").read_text()
    named = set(re.findall(r"`(vllm:[a-z_]+)`", text))
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:cache_config_info"} <= named
    src = (ROOT / "engine" / "server" / "metrics.py").read_text()
    assert all(f'"{m}"' in src for m in named), [m for m in named if f'"{m}"' not in src]
