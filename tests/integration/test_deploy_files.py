"""The deployment files (docker/Dockerfile, docker-compose.yml, deploy/kubernetes/*.yaml,
deploy/torchx/, docs/deploy.md) checked without Docker, a cluster or torchx: their
structure, and every container, pod, component and guide command dry-run through
`disttrain ... --check-config` here, with test values for what only exists there."""

import importlib.util
import json
import re
import shlex
import string
import subprocess
import sys

import pytest
import yaml
from conftest import REPO_ROOT

from disttrain.core.credentials import Credentials
from disttrain.core.identity import node_token
from disttrain.core.pki import DEFAULT_HOSTS, NodeName, write_run_pki

pytestmark = pytest.mark.timeout(240)

TOKEN = "deploy-test-token-0123456789"
COMPOSE = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
MANIFESTS = {path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
             for path in sorted((REPO_ROOT / "deploy" / "kubernetes").glob("*.yaml"))}
GUIDE = (REPO_ROOT / "docs" / "deploy.md").read_text()


def dry_run(cli, args, cwd, token=TOKEN):
    """`disttrain ARGS --check-config` with the token in the environment; the result."""
    return cli(*args, "--check-config", cwd=cwd, timeout=200, env={"DISTTRAIN_TOKEN": token})


def manifest(kind, name):
    found = [doc for docs in MANIFESTS.values() for doc in docs
             if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def containers():
    """(manifest, container, pod spec, replicas) for every container of every workload."""
    for docs in MANIFESTS.values():
        for doc in docs:
            if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
                spec = doc["spec"]["template"]["spec"]
                replicas = doc["spec"].get("replicas", doc["spec"].get("completions", 1))
                for container in spec["containers"]:
                    yield doc, container, spec, replicas


def flag(args, name):
    return args[args.index(name) + 1]


def expand(args, values):
    """Kubernetes' $(VAR) expansion of a container's args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], arg) for arg in args]


# --- Dockerfile -------------------------------------------------------------------------

def dockerfile_instructions():
    text = (REPO_ROOT / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [tuple(line.split(None, 1)) for line in lines]


def test_dockerfile_parses_into_the_expected_instructions():
    instructions = dockerfile_instructions()
    assert all(name.isupper() for name, _ in instructions), instructions
    by_name = {}
    for name, value in instructions:
        by_name.setdefault(name, []).append(value)
    # deps (the dependencies' environment), build (the project's files), then the image
    assert instructions[0] == ("ARG", "BASE_IMAGE=python:3.11-slim")
    assert by_name["FROM"] == ["${BASE_IMAGE} AS deps", "deps AS build", "${BASE_IMAGE}"]
    args = dict(value.split("=", 1) for value in by_name["ARG"])
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    lock = (REPO_ROOT / "requirements.lock").read_text()
    assert f"\ntorch=={args['TORCH_VERSION']}\n" in lock  # the image installs the tested torch
    runs = " ".join(by_name["RUN"])
    assert '"torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"' in runs
    # the tested versions of the rest, from docker/wheels/ (no network) or the indexes
    assert runs.count("-c requirements.lock -r dependencies.txt") == 2
    assert "--no-index --find-links wheels" in runs
    assert "venv --without-pip /opt/disttrain" in runs  # pip never enters the image's environment
    assert by_name["WORKDIR"][-1] == "/app"
    assert by_name["COPY"] == ["pyproject.toml requirements.lock ./", "docker/wheels ./wheels",
                               "README.md ./", "src ./src", "--from=deps /opt/disttrain /opt/disttrain",
                               "--from=build /stage/ /"]
    names = [name for name, _ in instructions]
    final = names[len(names) - 1 - names[::-1].index("FROM"):]
    assert final.count("RUN") == 1 and final.index("RUN") < final.index("COPY")  # the user, then the files
    assert len(by_name["USER"]) == 1 and by_name["USER"][0] not in ("root", "0")
    assert [name for name, _ in instructions].index("USER") > max(
        i for i, (name, _) in enumerate(instructions) if name == "RUN")  # nothing runs as root after
    assert json.loads(by_name["ENTRYPOINT"][0]) == ["disttrain"]
    ignore = (REPO_ROOT / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*"):][:6] == ["*", "!pyproject.toml", "!README.md", "!requirements.lock",
                                             "!src/", "!docker/wheels/"]
    # the wheels fetched for the build never go into version control
    ignored = subprocess.run(["git", "check-ignore", "-q", "docker/wheels/torch-0-cp311-none-any.whl"],
                             cwd=REPO_ROOT, timeout=60)
    assert ignored.returncode == 0


# --- Compose ----------------------------------------------------------------------------

RUN_DIR = "${DISTTRAIN_RUN_DIR:-./runs/cluster}"


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` with VAR unset: the default."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def test_compose_services_network_volumes_and_token():
    services = COMPOSE["services"]
    assert {"parameter_server", "worker_0", "worker_1", "coordinator"} <= set(services)
    assert "training_net" in COMPOSE["networks"]
    for name, service in services.items():
        assert service["networks"] == ["training_net"], name
        assert service["volumes"] == [f"{RUN_DIR}/checkpoints:/app/checkpoints", f"{RUN_DIR}/logs:/app/logs",
                                      f"{RUN_DIR}/config:/app/config:ro"], name
        assert service["shm_size"] and service["restart"] == "on-failure:5", name
        assert "DISTTRAIN_TOKEN" not in service.get("environment", {}), name  # the token never inline
        assert not any(arg.startswith("--token") for arg in service["command"]), name
        assert flag(service["command"], "--config") == "${DISTTRAIN_CONFIG:-ps_sync_mnist}", name
    # The secret for the servers, which check every caller; each worker its own node token.
    for name in ("coordinator", "parameter_server"):
        assert services[name]["env_file"] == f"{RUN_DIR}/secrets/disttrain.env", name
    server = services["parameter_server"]["command"]
    assert server[0] == "ps-server" and flag(server, "--bind") == "0.0.0.0:50051"
    made = re.search(r"^workers=\((.*)\)", (REPO_ROOT / "docker" / "cluster_env.sh").read_text(), re.M)
    assert made and made.group(1).split() == ["worker0", "worker1"]  # the node tokens cluster_env.sh makes
    for rank in (0, 1):
        worker = services[f"worker_{rank}"]["command"]
        assert worker[0] == "ps-worker" and flag(worker, "--servers") == "parameter_server:50051"
        assert flag(worker, "--rank") == str(rank) and "--resume" in worker
        assert flag(worker, "--worker-id") == f"worker{rank}"
        assert services[f"worker_{rank}"]["env_file"] == f"{RUN_DIR}/secrets/worker{rank}.env"
        assert services[f"worker_{rank}"]["depends_on"]["parameter_server"]["condition"] == "service_healthy"


def test_compose_health_checks_answer_from_a_real_server_and_fail_once_it_stops():
    import grpc

    from disttrain.core.rpc_server import RpcServer, ServerLimits

    for name, port in (("parameter_server", "50051"), ("coordinator", "50050")):
        kind, line = COMPOSE["services"][name]["healthcheck"]["test"]
        assert kind == "CMD-SHELL" and line.startswith("python3 -c ") and "grpc_health.v1" in line
        server = RpcServer(grpc.method_handlers_generic_handler("test.Nothing", {}), "test.Nothing",
                           "127.0.0.1:0", ServerLimits(4),
                           Credentials(TOKEN))  # the health service needs no token
        line = shlex.quote(sys.executable) + line.removeprefix("python3")
        probe = ["sh", "-c", line.replace(f"localhost:{port}", server.address)]
        try:
            assert subprocess.run(probe, timeout=60).returncode == 0
        finally:
            server.stop(0)
        assert subprocess.run(probe, timeout=60, capture_output=True).returncode != 0


@pytest.mark.slow
@pytest.mark.parametrize("service", sorted(COMPOSE["services"]))
def test_compose_command_passes_check_config(cli, tmp_path, service):
    command = [interpolate(arg) for arg in COMPOSE["services"][service]["command"]]
    result = dry_run(cli, command, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{command[0]}: ") and "with token" in result.stdout
    assert list(tmp_path.iterdir()) == []


# --- Kubernetes -------------------------------------------------------------------------

def test_kubernetes_ps_job_structure():
    secret = manifest("Secret", "disttrain-token")
    assert secret["stringData"] == {"token": ""}  # shipped empty: nothing runs until it is set
    servers, service = manifest("StatefulSet", "ps-server"), manifest("Service", "ps-server")
    assert servers["spec"]["serviceName"] == "ps-server" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == servers["spec"]["template"]["metadata"]["labels"]
    replicas = servers["spec"]["replicas"]
    server_args = servers["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag(server_args, "--shard") == f"$(SHARD_INDEX)/{replicas}"
    names = [f"ps-server-{i}.ps-server:50051" for i in range(replicas)]
    coordinator = manifest("Deployment", "coordinator")["spec"]["selector"]["matchLabels"]
    assert manifest("Service", "coordinator")["spec"]["selector"] == coordinator
    tokens = manifest("Secret", "disttrain-node-tokens")["stringData"]
    assert tokens == {f"worker{rank}": "" for rank in range(len(tokens))}  # shipped empty too
    for rank in range(len(tokens)):  # a Job per worker: its pod reads only its own token
        pod = manifest("Job", f"ps-worker-{rank}")["spec"]["template"]["spec"]
        worker_args = pod["containers"][0]["args"]
        assert flag(worker_args, "--servers") == ",".join(names)
        assert flag(worker_args, "--coordinator") == flag(server_args, "--coordinator") == "coordinator:50050"
        assert (flag(worker_args, "--rank"), flag(worker_args, "--worker-id")) == (str(rank), f"worker{rank}")


def test_kubernetes_ddp_job_rendezvous_at_the_first_pod():
    job, service = manifest("Job", "ddp"), manifest("Service", "ddp")
    pod = job["spec"]["template"]
    assert job["spec"]["completionMode"] == "Indexed" and pod["spec"]["subdomain"] == "ddp"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == pod["metadata"]["labels"]
    args = pod["spec"]["containers"][0]["args"]
    assert flag(args, "--rdzv-endpoint") == "ddp-0.ddp:29400"  # pod 0's name under the headless Service
    assert int(flag(args, "--nnodes")) == job["spec"]["completions"] == job["spec"]["parallelism"]


def test_every_container_takes_its_own_credentials_from_a_secret():
    """The pods that check callers read the run's secret; a worker's pod only its own node
    token, and no other key of any Secret."""
    for doc, container, _, _ in containers():
        env = {item["name"]: item for item in container["env"]}
        args = container["args"]
        if args[0] == "ps-worker":
            reference = {"secretKeyRef": {"name": "disttrain-node-tokens", "key": flag(args, "--worker-id")}}
        else:
            reference = {"secretKeyRef": {"name": "disttrain-token", "key": "token"}}
        assert env["DISTTRAIN_TOKEN"]["valueFrom"] == reference, doc["metadata"]["name"]
        assert [item for item in container["env"] if "secretKeyRef" in item.get("valueFrom", {})] \
            == [env["DISTTRAIN_TOKEN"]], doc["metadata"]["name"]
        assert "volumes" not in doc["spec"]["template"]["spec"] or not any(
            "secret" in volume for volume in doc["spec"]["template"]["spec"]["volumes"])
        assert doc["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def kubernetes_commands():
    """Every distinct pod command, expanded for each pod index."""
    commands = {}
    for doc, container, _, replicas in containers():
        for index in range(replicas):
            args = expand(container["args"], {"SHARD_INDEX": str(index), "RANK": str(index)})
            commands[" ".join(args)] = (f"{doc['kind']}/{doc['metadata']['name']}", args)
    return sorted(commands.values())


@pytest.mark.slow
@pytest.mark.parametrize("name,args", kubernetes_commands())
def test_kubernetes_command_passes_check_config(cli, tmp_path, name, args):
    worker = args[0] == "ps-worker"  # with its own node token, as its pod gets it
    result = dry_run(cli, args, tmp_path, token=node_token(TOKEN, flag(args, "--worker-id"), "worker")
                     if worker else TOKEN)
    assert result.returncode == 0, f"{name}: {result.stderr}"
    assert "with token" in result.stdout and list(tmp_path.iterdir()) == []


def test_the_shipped_empty_secret_is_refused(cli, tmp_path):
    token = manifest("Secret", "disttrain-token")["stringData"]["token"]
    args = manifest("Deployment", "coordinator")["spec"]["template"]["spec"]["containers"][0]["args"]
    result = dry_run(cli, args, tmp_path, token=token)
    assert result.returncode == 2 and "DISTTRAIN_TOKEN" in result.stderr


# --- torchx -----------------------------------------------------------------------------

def load_component():
    path = REPO_ROOT / "deploy" / "torchx" / "disttrain_ddp.py"
    spec = importlib.util.spec_from_file_location("disttrain_ddp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("rank0_host", [None, "node-a"])
def test_torchx_command_through_bash_passes_check_config(tmp_path, rank0_host):
    component = load_component()
    args = component.ddp_args(2, 1, "ddp_mnist", component.RANK0_HOST, "${app_id}", 3, None,
                              ["--check-config"])
    # torchx fills its macros (`$$` becomes `$`), then bash runs the line on each replica.
    line = string.Template(component.shell_line(args)).substitute(app_id="disttrain-ddp-x1")
    line = line.replace("exec disttrain ", f"exec {shlex.quote(sys.executable)} -m disttrain ", 1)
    env = {"PATH": "/usr/bin:/bin", "DISTTRAIN_TOKEN": TOKEN}
    if rank0_host:
        env["TORCHX_RANK0_HOST"] = rank0_host
    result = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=200, env=env,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"rendezvous at {rank0_host or 'localhost'}:29400" in result.stdout
    assert "up to 3 restarts" in result.stdout and "ddp: 1 rank on this node of 2" in result.stdout


def test_torchx_component_builds_its_app():
    pytest.importorskip("torchx", reason="torchx is not installed: the AppDef is not built here")
    component = load_component()
    app = component.ddp(nnodes=2)
    (role,) = app.roles
    assert role.num_replicas == 2 and role.entrypoint == "bash"
    assert role.args[1].startswith("exec disttrain ddp --config ddp_mnist --world-size 2")


# --- the guide --------------------------------------------------------------------------

def guide_commands(program):
    """The `program ...` lines of the guide's bash blocks, continuations joined."""
    blocks = re.findall(r"```bash\n(.*?)```", GUIDE, re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.startswith(program + " ")]


@pytest.mark.slow
def test_every_disttrain_command_of_the_guide_passes_check_config(cli, tmp_path):
    commands = guide_commands("disttrain")
    assert len(commands) >= 6
    write_run_pki(tmp_path, DEFAULT_HOSTS, [NodeName("server0", "server")], days=1)  # the guide's shard 0
    (tmp_path / "disttrain.token").write_text(TOKEN)
    (tmp_path / "disttrain.token").chmod(0o600)
    (tmp_path / "worker0.token").write_text(node_token(TOKEN, "worker0", "worker"))  # a worker's own
    (tmp_path / "worker0.token").chmod(0o600)
    made = tmp_path / "made"  # where the guide's token commands make their files, in its order
    made.mkdir()
    for args in commands:
        if args[1] == "token":  # makes a file and starts nothing: run as written
            result = cli(*args[1:], cwd=made, timeout=60)
        else:
            result = dry_run(cli, args[1:], tmp_path)
        assert result.returncode == 0, f"{shlex.join(args)}: {result.stderr}"


def test_every_file_the_guide_names_exists():
    named = set(re.findall(r"\b((?:docker|deploy|docs|tests)/[\w./-]+\.(?:yaml|py|md|sh)|docker/Dockerfile)",
                           GUIDE))
    assert named and all((REPO_ROOT / path).is_file() for path in named), named
    for args in guide_commands("kubectl"):
        files = [args[i + 1] for i, arg in enumerate(args) if arg == "-f" and args[i + 1] != "-"]
        assert all((REPO_ROOT / path).is_file() for path in files), args
