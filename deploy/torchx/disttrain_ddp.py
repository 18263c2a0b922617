"""A torchx component for disttrain's DDP strategy: one role of `nnodes` replicas, each
running `disttrain ddp` (torch's elastic agent) with the c10d rendezvous at the first
replica, whose host torchx's schedulers put in TORCHX_RANK0_HOST.

    torchx run -s local_cwd deploy/torchx/disttrain_ddp.py:ddp --nnodes 2
    torchx run -s kubernetes deploy/torchx/disttrain_ddp.py:ddp --image REGISTRY/disttrain:latest \
        --nnodes 2 --token_file /app/run/token -- --checkpoint-dir /app/run/ddp/checkpoints

The command itself is built by `ddp_args` and `shell_line`, which need no torchx, so it
can be checked where torchx is not installed; `ddp` exists only where torchx imports.
"""

import shlex

try:
    from torchx import specs
except ModuleNotFoundError:  # the command builders below still work
    specs = None

RDZV_PORT = 29400
# `$$` is a literal `$` after torchx fills its macros; bash then expands the variable.
RANK0_HOST = "$${TORCHX_RANK0_HOST:=localhost}"


def ddp_args(nnodes: int, nproc_per_node: int, config: str, rdzv_host: str, rdzv_id: str,
             max_restarts: int, token_file: str | None, extra: list[str]) -> list[str]:
    """The `disttrain ddp` command line of every replica (without the leading `disttrain`).

    Args:
        nnodes: replicas (nodes); nproc_per_node: ranks on each, so the world size is their
            product. config: a shipped config's name or a file in the image. rdzv_host: the
            first replica's host (RANK0_HOST in the component). rdzv_id: shared by the run's
            nodes. max_restarts: restarts of the rank group. token_file: a private file
            holding the run's token, or None for DISTTRAIN_TOKEN in the environment.
            extra: further disttrain flags, appended last.

    Raises:
        ValueError: nnodes or nproc_per_node below 1.
    """
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"nnodes={nnodes}, nproc_per_node={nproc_per_node}: both must be >= 1")
    args = ["ddp", "--config", config, "--world-size", str(nnodes * nproc_per_node),
            "--nnodes", str(nnodes), "--rdzv-endpoint", f"{rdzv_host}:{RDZV_PORT}",
            "--rdzv-id", rdzv_id, "--max-restarts", str(max_restarts), "--resume"]
    if token_file:
        args += ["--token-file", token_file]
    return args + list(extra)


def shell_line(args: list[str]) -> str:
    """`exec disttrain ARGS` for bash -c: every argument quoted but the rendezvous
    endpoint, which bash must expand."""
    quoted = (arg if arg.startswith(RANK0_HOST) else shlex.quote(arg) for arg in args)
    return "exec disttrain " + " ".join(quoted)


if specs is not None:
    def ddp(*script_args: str, image: str = "disttrain:latest", nnodes: int = 2, nproc_per_node: int = 1,
            config: str = "ddp_mnist", max_restarts: int = 3, token_file: str | None = None,
            cpu: int = 2, gpu: int = 0, memMB: int = 4096) -> specs.AppDef:  # noqa: N803 (torchx's name)
        """disttrain DDP over several nodes, with the c10d rendezvous at the first one.

        Args:
            script_args: further `disttrain ddp` flags (after --)
            image: the image built from docker/Dockerfile
            nnodes: nodes (replicas)
            nproc_per_node: ranks per node (GPUs per node with a CUDA image)
            config: a shipped config's name, or a config file in the image
            max_restarts: restarts of the rank group after a failure
            token_file: a private file (chmod 600) in the container holding the run's token
            cpu: CPUs per replica
            gpu: GPUs per replica
            memMB: memory per replica in MB
        """
        args = ddp_args(nnodes, nproc_per_node, config, RANK0_HOST, specs.macros.app_id, max_restarts,
                        token_file, list(script_args))
        role = specs.Role(name="ddp", image=image, entrypoint="bash", args=["-c", shell_line(args)],
                          num_replicas=nnodes, resource=specs.Resource(cpu=cpu, gpu=gpu, memMB=memMB),
                          port_map={"c10d": RDZV_PORT}, max_retries=max_restarts)
        return specs.AppDef(name="disttrain-ddp", roles=[role])
