"""The deployment recipes in deploy/: the Kubernetes manifests and the Slurm script.

The manifests are validated offline against Kubernetes' own schemas (kubernetes-validate), their
cross-references are checked (Services select the router's pods, Secret references name keys the
generated Secret has, the ports the workers are told equal the ports they declare), and every
command line in them is parsed with tandem's own parser, so a renamed flag fails here. The Slurm
script runs under bash with a fake `scontrol`: in dry-run mode for its command lines, and with a
fake `srun` and `curl` for its supervision (ready, then no step left once it ends).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from process_tree import alive
from tandem.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
SBATCH = DEPLOY / "slurm" / "tandem-xpyd.sbatch"
KUBERNETES_VERSION = "1.35.0"
POD_IP = "10.1.2.3"
SECRET_ENV_NAMES = ("TANDEM_CLUSTER_TOKEN", "TANDEM_API_KEY")
SECRET_FLAGS = ("--cluster-token", "--api-key")


# --- Kubernetes ----------------------------------------------------------------------------------


def kustomization() -> dict:
    return yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())


@functools.cache
def manifests() -> tuple[dict, ...]:
    """Every resource the kustomization applies, in its order (shared: copy one to change it)."""
    return tuple(
        doc
        for name in kustomization()["resources"]
        for doc in yaml.safe_load_all((KUBERNETES / name).read_text())
        if doc
    )


def of_kind(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in manifests() if doc["kind"] == kind}


def deployment(name: str) -> dict:
    return of_kind("Deployment")[name]


def pod_labels(name: str) -> dict[str, str]:
    return deployment(name)["spec"]["template"]["metadata"]["labels"]


def container(name: str) -> dict:
    (only,) = deployment(name)["spec"]["template"]["spec"]["containers"]
    return only


def container_ports(name: str) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container(name)["ports"]}


def service_selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions with In) against pod labels."""
    if not service_selects(selector.get("matchLabels", {}), labels):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", "only In is understood here"
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def expanded_command(name: str) -> list[str]:
    """The container's command line as the kubelet runs it: $(VAR) replaced by the container's
    env (the downward API's pod IP given POD_IP); an undefined $(VAR) would be passed on as it is,
    so it fails the test."""
    values = {}
    for env in container(name)["env"]:
        field = env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if field == "status.podIP":
            values[env["name"]] = POD_IP

    def expand(word: str) -> str:
        def one(match: re.Match) -> str:
            assert match.group(1) in values, f"{name}: $({match.group(1)}) is not defined"
            return values[match.group(1)]

        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, word)

    return [expand(str(word)) for word in container(name)["command"] + container(name)["args"]]


@functools.cache
def tandem_parser():
    return build_parser()


def parsed(command: list[str]):
    assert command[0] == "tandem"
    return tandem_parser().parse_args(command[1:])


def test_every_manifest_is_valid_kubernetes():
    docs = manifests()
    assert {doc["kind"] for doc in docs} >= {"Deployment", "Service", "PersistentVolumeClaim"}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_validation_catches_a_broken_manifest():
    broken = copy.deepcopy(deployment("tandem-router"))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    misspelt = copy.deepcopy(deployment("tandem-decode"))
    misspelt["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSION, strict=True)


def test_kustomization_applies_every_manifest_and_generates_the_secret():
    config = kustomization()
    listed = set(config["resources"])
    on_disk = {path.name for path in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    (generator,) = config["secretGenerator"]
    assert generator["name"] == "tandem-secrets" and generator["envs"] == ["secrets.env"]
    assert "secrets.env" in (KUBERNETES / ".gitignore").read_text().split()
    images = {image["name"] for image in config["images"]}
    for name in of_kind("Deployment"):
        assert container(name)["image"] in images


def secret_keys() -> dict[str, str]:
    """The keys of the generated Secret: secrets.env.example's lines, with their (empty) values."""
    lines = (KUBERNETES / "secrets.env.example").read_text().splitlines()
    pairs = [line.split("=", 1) for line in lines if line.strip() and not line.startswith("#")]
    return {key: value for key, value in pairs}


def test_secret_references_name_keys_of_the_secret():
    keys = secret_keys()
    assert set(keys) == {"cluster-token", "api-key"}
    generated = kustomization()["secretGenerator"][0]["name"]
    refs = {}
    for name in of_kind("Deployment"):
        for env in container(name)["env"]:
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == generated and ref["key"] in keys, (name, env)
                refs[(name, env["name"])] = ref
    for name in of_kind("Deployment"):
        token = refs[(name, "TANDEM_CLUSTER_TOKEN")]
        assert token["key"] == "cluster-token" and not token.get("optional", False)
        assert refs[(name, "TANDEM_API_KEY")]["key"] == "api-key"


def test_no_secret_is_written_into_a_manifest():
    assert all(value == "" for value in secret_keys().values())
    for name in of_kind("Deployment"):
        for env in container(name)["env"]:
            if env["name"] in SECRET_ENV_NAMES:
                assert "value" not in env and "secretKeyRef" in env["valueFrom"]
        assert not set(expanded_command(name)) & set(SECRET_FLAGS)
    assert "kind: Secret" not in "".join(p.read_text() for p in KUBERNETES.glob("*.yaml"))


def test_router_services_select_the_router_pods():
    router_labels = pod_labels("tandem-router")
    services = of_kind("Service")
    assert set(services) == {"tandem-router", "tandem-router-internal"}
    for service in services.values():
        assert service_selects(service["spec"]["selector"], router_labels)
        for worker in ("tandem-prefill", "tandem-decode"):
            assert not service_selects(service["spec"]["selector"], pod_labels(worker))
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] in container_ports("tandem-router")
    assert services["tandem-router-internal"]["spec"]["publishNotReadyAddresses"] is True
    assert not services["tandem-router"]["spec"].get("publishNotReadyAddresses", False)


def test_router_command_and_probes():
    args = parsed(expanded_command("tandem-router"))
    assert args.command == "router" and args.host == "0.0.0.0"
    assert args.port == container_ports("tandem-router")["http"]
    probes = container("tandem-router")
    assert probes["readinessProbe"]["httpGet"]["path"] == "/health"
    # the router's /health is a 503 until a decode worker registers: never its liveness
    assert probes["livenessProbe"]["httpGet"]["path"] != "/health"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_command_parses_and_matches_its_pod(role):
    name = f"tandem-{role}"
    args = parsed(expanded_command(name))
    ports = container_ports(name)
    assert (args.command, args.role) == ("worker", role)
    assert args.host == "0.0.0.0" and args.kv_host == POD_IP
    assert args.port == ports["http"]
    assert args.advertise_url == f"http://{POD_IP}:{ports['http']}"
    if role == "prefill":
        assert args.kv_port == ports["kv"]
    else:  # a decode worker serves no KV: it declares no KV port and is given none
        assert "kv" not in ports and "--kv-port" not in expanded_command(name)
    assert args.kv_transport == "tcp"
    assert args.cluster_token is None and args.api_key is None  # from the environment
    # registers through the Service that reaches the router before it is ready
    router = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", args.router)
    internal = of_kind("Service")["tandem-router-internal"]
    assert router.group(1) == "tandem-router-internal"
    assert int(router.group(2)) == internal["spec"]["ports"][0]["port"]
    worker = container(name)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert args.device == "cuda"
    volumes = {v["name"]: v for v in deployment(name)["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    claim = volumes["model"]["persistentVolumeClaim"]["claimName"]
    assert claim in of_kind("PersistentVolumeClaim")
    assert Path(args.model).is_relative_to(mounts["model"])


def test_network_policy_closes_the_workers_to_all_but_the_cluster():
    (policy,) = of_kind("NetworkPolicy").values()
    spec = policy["spec"]
    for name in ("tandem-prefill", "tandem-decode"):
        assert selects(spec["podSelector"], pod_labels(name))
    assert not selects(spec["podSelector"], pod_labels("tandem-router"))
    (rule,) = spec["ingress"]
    (peer,) = rule["from"]
    for name in ("tandem-router", "tandem-prefill", "tandem-decode"):
        assert selects(peer["podSelector"], pod_labels(name))


# --- Slurm ---------------------------------------------------------------------------------------

HOSTS = ("tn-a1", "tn-a2", "tn-b1", "tn-b2")  # names that resolve nowhere: the script uses them


def fake_bin(tmp_path: Path) -> Path:
    """scontrol answering four hosts, and srun and curl that only record that they ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "scontrol": '[ "$1 $2" = "show hostnames" ] || exit 2\nprintf "%s\\n" ' + " ".join(HOSTS),
        # decode-1's process ignores SIGTERM, as a stuck one would: only SIGKILL ends it
        "srun": 'echo "$$ $*" >> "$FAKE_CALLS"\n'
        "if [[ $* == *--job-name=decode-1* ]]; then trap '' TERM; fi\nexec sleep 300",
        # the last argument is the URL; the router's /health counts every worker of the job
        "curl": 'echo "curl ${*: -1}" >> "$FAKE_CALLS"\ncase "${*: -1}" in\n'
        '*:8000/health) echo \'{"status":"ok","workers":{"prefill":2,"decode":2,"both":0}}\';;\n'
        "esac",
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    return bin_dir


def slurm_env(tmp_path: Path, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TANDEM_"))}
    env.update(
        PATH=f"{fake_bin(tmp_path)}:{env['PATH']}",
        SLURM_JOB_NODELIST="tn-[a1-a2,b1-b2]",
        SLURM_JOB_ID="42",
        FAKE_CALLS=str(tmp_path / "calls"),
        LOG_DIR=str(tmp_path / "logs"),
        NUM_PREFILL="2",
        NUM_DECODE="2",
        STOP_TIMEOUT="2",
    )
    env.update(settings)
    return env


def dry_run(tmp_path: Path, *args: str, **settings: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SBATCH), *args],
        env=slurm_env(tmp_path, **settings),
        capture_output=True,
        text=True,
        timeout=60,
    )


def srun_lines(stdout: str) -> list[dict]:
    """Each printed srun command: its host, its name, and the tandem command it runs."""
    steps = []
    for line in stdout.splitlines():
        if line.startswith("#"):
            continue
        words = shlex.split(line)
        assert words[0] == "srun", line
        start = words.index("tandem")
        options = words[1:start]
        host = options[options.index("-w") + 1]
        (name,) = [o.split("=", 1)[1] for o in options if o.startswith("--job-name=")]
        steps.append({"host": host, "name": name, "args": parsed(words[start:])})
    return steps


def test_sbatch_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True, timeout=30)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(SBATCH)], check=True, timeout=60)


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_sbatch_dry_run_places_router_and_workers(tmp_path, how):
    token = "token-from-the-environment-0123456789"
    extra = {"TANDEM_CLUSTER_TOKEN": token}
    if how == "flag":
        result = dry_run(tmp_path, "--dry-run", **extra)
    else:
        result = dry_run(tmp_path, TANDEM_DRY_RUN="1", **extra)
    assert result.returncode == 0, result.stderr
    assert token not in result.stdout + result.stderr
    assert not (tmp_path / "calls").exists(), "a dry run started srun or curl"
    steps = srun_lines(result.stdout)
    router, workers = steps[0], steps[1:]
    assert router["args"].command == "router" and router["host"] == HOSTS[0]
    assert (router["args"].host, router["args"].port) == ("0.0.0.0", 8000)
    expected_roles = ["prefill", "prefill", "decode", "decode"]
    assert [w["args"].role for w in workers] == expected_roles
    assert [w["host"] for w in workers] == list(HOSTS)
    assert [w["name"] for w in workers] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    for worker, host in zip(workers, HOSTS, strict=True):
        args = worker["args"]
        assert args.command == "worker" and args.host == "0.0.0.0" and args.port == 8100
        assert args.kv_host == host and args.advertise_url == f"http://{host}:8100"
        assert args.router == f"http://{HOSTS[0]}:8000"
        assert args.kv_transport == "tcp" and args.cluster_token is None
        assert args.kv_port == (8200 if args.role == "prefill" else 0)


def test_sbatch_dry_run_several_workers_per_node(tmp_path):
    result = dry_run(tmp_path, "--dry-run", NUM_PREFILL="1", NUM_DECODE="1", WORKERS_PER_NODE="2")
    assert result.returncode == 0, result.stderr
    assert "tn-b1 tn-b2 stay unused" in result.stderr
    workers = [step["args"] for step in srun_lines(result.stdout)[1:]]
    assert [(w.role, w.device, w.port, w.kv_port) for w in workers] == [
        ("prefill", "cuda:0", 8100, 8200),
        ("prefill", "cuda:1", 8101, 8201),
        ("decode", "cuda:0", 8100, 0),
        ("decode", "cuda:1", 8101, 0),
    ]


def test_sbatch_refuses_too_few_nodes(tmp_path):
    result = dry_run(tmp_path, "--dry-run", NUM_PREFILL="3", NUM_DECODE="2")
    assert result.returncode == 1
    assert "need 5 nodes, but the job has 4: submit with sbatch --nodes=5" in result.stderr


def started_steps(calls: Path) -> list[int]:
    if not calls.exists():
        return []
    return [int(line.split()[0]) for line in calls.read_text().splitlines() if line[0].isdigit()]


def wait_for_ready(process: subprocess.Popen) -> None:
    for line in process.stdout:
        if "ready at http://tn-a1:8000/v1" in line:
            return
    raise AssertionError(f"never ready: {process.stderr.read()}")


@pytest.mark.parametrize("ending", ["sigterm", "step-exits"])
def test_sbatch_stops_every_step_when_the_job_ends(tmp_path, ending):
    process = subprocess.Popen(
        ["bash", str(SBATCH)],
        env=slurm_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for_ready(process)
        steps = started_steps(tmp_path / "calls")
        assert len(steps) == 5 and all(alive(pid) for pid in steps)
        if ending == "sigterm":  # scancel, or the time limit's warning signal
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 143
        else:  # a worker dies: the job ends, with the others
            os.kill(steps[2], signal.SIGKILL)
            assert process.wait(timeout=30) == 1
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in steps) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in steps)
    finally:  # a failing run leaves nothing behind either
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for pid in started_steps(tmp_path / "calls"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
