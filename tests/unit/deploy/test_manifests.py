"""deploy/kuberay validated offline (no Kubernetes cluster runs in CI): core
objects against kubernetes-validate's bundled schemas, the RayCluster against
KubeRay's own CRD schema (raycluster_v1.schema.yaml, vendored), and the pieces
checked against each other: the keys `epd keys` writes, the flags `epd serve`
takes, the resources Ray places the workers by, the image the pods run."""
from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from epd.cli import build_parser
from epd.transport.wire.auth import make_keys

ROOT = Path(__file__).resolve().parents[3]
MANIFEST = ROOT / "deploy" / "kuberay" / "raycluster.yaml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
RAYCLUSTER_SCHEMA = Path(__file__).with_name("raycluster_v1.schema.yaml")
K8S_VERSION = kubernetes_validate.latest_version()
# `epd serve --cluster ray` flags that arrive with the Ray launcher (issue #13, another branch);
# until then the parser here does not know them, and nothing else may be unknown
RAY_LAUNCHER_FLAGS = {"--cluster", "--ray-address", "--encoder-resources", "--prefill-resources",
                      "--decode-resources"}


def documents() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def raycluster() -> dict:
    return next(d for d in documents() if d["kind"] == "RayCluster")


def strict(schema: dict) -> dict:
    """The schema refusing unknown fields wherever it lists the known ones, as the API
    server's strict field validation (`kubectl apply --validate=strict`) does."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def validate_raycluster(doc: dict) -> None:
    schema = strict(yaml.safe_load(RAYCLUSTER_SCHEMA.read_text()))
    jsonschema.validate(doc, schema, cls=jsonschema.Draft4Validator)


def serve_command(head: dict) -> list[str]:
    """The `epd serve ...` argv of the head container's shell command."""
    script = " ".join(head["args"])
    return shlex.split(script[script.index("exec epd serve") + len("exec epd "):])


def test_core_objects_are_valid_kubernetes():
    kinds = []
    for doc in documents():
        if doc["kind"] == "RayCluster":
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["PersistentVolumeClaim", "Service"]


def test_the_raycluster_is_valid_against_kuberays_crd_schema():
    doc = raycluster()
    assert doc["apiVersion"] == "ray.io/v1"
    validate_raycluster(doc)


@pytest.mark.parametrize("break_it, where", [
    (lambda d: d["spec"]["workerGroupSpecs"][0].update(minReplica=1), "minReplica"),  # a typo
    (lambda d: d["spec"]["workerGroupSpecs"][0].update(replicas="one"), "'one'"),
    (lambda d: d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].pop("name"), "'name'"),
    (lambda d: d["spec"]["headGroupSpec"].update(rayStartParams={"num-cpus": 0}), "0"),  # strings only
])
def test_the_crd_schema_catches_mistakes(break_it, where):
    doc = raycluster()
    break_it(doc)
    with pytest.raises(jsonschema.ValidationError, match=where):
        validate_raycluster(doc)


def test_a_secret_made_from_epd_keys_is_valid_and_holds_every_file_the_pods_mount(tmp_path):
    keys = make_keys(tmp_path / "plane-keys")
    files = {p.name: p.read_bytes() for p in keys.iterdir()}
    # what `kubectl create secret generic epd-plane-keys --from-file=plane-keys` makes
    import base64

    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "epd-plane-keys"}, "type": "Opaque",
              "data": {name: base64.b64encode(data).decode() for name, data in files.items()}}
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    assert all(re.fullmatch(r"[-._a-zA-Z0-9]+", name) for name in files)  # valid Secret keys

    spec = raycluster()["spec"]
    pods = {"head": spec["headGroupSpec"]["template"]["spec"]} | {
        g["groupName"]: g["template"]["spec"] for g in spec["workerGroupSpecs"]}
    for group, pod in pods.items():
        volume = next(v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "epd-plane-keys")
        mounted = {item["key"] for item in volume["secret"]["items"]}
        assert mounted <= set(files), (group, mounted - set(files))
        # each pod holds its own role's secret and no other (the head: the API's; workers: the workers')
        secret_key = "api.key_secret" if group == "head" else "worker.key_secret"
        assert mounted == {secret_key, "api.key", "worker.key"}, (group, mounted)
        mount = next(m for c in pod["containers"] for m in c["volumeMounts"] if m["name"] == volume["name"])
        assert mount["mountPath"] == "/etc/epd/keys" and mount["readOnly"]


def test_the_head_runs_epd_serve_with_flags_it_takes():
    head = raycluster()["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    argv = serve_command(head)
    args, unknown = build_parser().parse_known_args(argv)
    assert {a for a in unknown if a.startswith("--")} <= RAY_LAUNCHER_FLAGS, unknown
    assert args.worker_keys == "/etc/epd/keys" and args.mode == "e-p-d"
    from epd.processes.autoscale import EncoderScaling

    low, high = EncoderScaling.parse_range(args.encoders)
    encoder_group = next(g for g in raycluster()["spec"]["workerGroupSpecs"] if g["groupName"] == "encoders")
    assert (low, high) == (encoder_group["minReplicas"], encoder_group["maxReplicas"])  # one encoder a pod
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert (args.port, args.worker_port) == (ports["http"], ports["worker-plane"])


def test_ray_places_each_role_on_the_group_that_has_its_resources():
    spec = raycluster()["spec"]
    argv = serve_command(spec["headGroupSpec"]["template"]["spec"]["containers"][0])
    asked = {flag: json.loads(argv[argv.index(flag) + 1]) for flag in ("--encoder-resources", "--prefill-resources",
                                                                       "--decode-resources")}
    offered = {}
    for group in spec["workerGroupSpecs"]:
        custom = json.loads(json.loads(group["rayStartParams"]["resources"]))  # a quoted JSON string, as ray start takes
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        offered[group["groupName"]] = custom | {"CPU": float(limits["cpu"]), "GPU": float(limits.get("nvidia.com/gpu", 0))}

    def fits(need: dict, group: str) -> bool:
        return all(offered[group].get(name, 0) >= amount for name, amount in need.items())

    assert [g for g in offered if fits(asked["--encoder-resources"], g)] == ["encoders"]
    assert [g for g in offered if fits(asked["--prefill-resources"], g)] == ["gpu"]
    assert [g for g in offered if fits(asked["--decode-resources"], g)] == ["gpu"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # the head runs the API only


def test_the_service_reaches_the_head_and_the_image_matches_the_ray_version():
    doc = raycluster()
    service = next(d for d in documents() if d["kind"] == "Service")
    assert service["spec"]["selector"] == {"ray.io/cluster": doc["metadata"]["name"], "ray.io/node-type": "head"}
    head = doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in head["ports"]}
    dockerfile = DOCKERFILE.read_text()
    base = re.search(r"^ARG BASE=rayproject/ray:([\d.]+)-", dockerfile, re.M).group(1)
    assert base == doc["spec"]["rayVersion"]
    for source in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", dockerfile, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), path
    claim = next(d for d in documents() if d["kind"] == "PersistentVolumeClaim")["metadata"]["name"]
    groups = [doc["spec"]["headGroupSpec"]] + doc["spec"]["workerGroupSpecs"]
    assert all(any(v.get("persistentVolumeClaim", {}).get("claimName") == claim for v in g["template"]["spec"]["volumes"])
               for g in groups)
