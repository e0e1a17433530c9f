"""Connecting to Ray: an existing cluster (address / RAY_ADDRESS, e.g. under `ray job
submit`) or an embedded local one.

Embedded (no address, no RAY_ADDRESS): always a new local Ray, even while a `ray start` cluster
runs on this machine. Ray 2.60 enables token authentication for it and generates its own token
(~/.ray/auth_token), so a newcomer sets nothing up.

Existing cluster: before `ray.init` (which, given a wrong address, retries for minutes, and
given a missing or wrong token fails only after ~20 s with a bare "Failed to connect"), one
gRPC call to the cluster's GCS with a short deadline tells apart, within seconds:
nothing listening / not a Ray GCS (e.g. the dashboard port) / no answer / token required but
not enabled or not found here / token rejected. Each is a `ClusterConnectionError` — a
ValueError, so `widedp` prints it as one line and exits with code 2.

Ray 2.60 token facts this relies on (read from the installed ray package):
  * `RAY_AUTH_MODE=token` turns token auth on for a process; the token is taken from
    `RAY_AUTH_TOKEN`, else the file named by `RAY_AUTH_TOKEN_PATH`, else ~/.ray/auth_token.
  * `ray.init(address=...)` with an explicit address (argument or RAY_ADDRESS) never turns
    token auth on by itself; only `RAY_AUTH_MODE=token` does. A driver started by `ray job
    submit` inherits RAY_AUTH_MODE / RAY_AUTH_TOKEN(_PATH) from the Ray node it runs on.
"""

from __future__ import annotations

import os
import socket
from typing import Optional

from widedp.trainer.config import DEFAULT_INLINE_BYTES  # cluster.inline_bytes' default

#: Seconds the pre-connection check waits for the cluster's GCS to answer.
CONNECT_TIMEOUT_S = 5.0

_TOKEN_HELP = (
    "set RAY_AUTH_MODE=token and give the cluster's token as RAY_AUTH_TOKEN=<token> or in a file named by "
    "RAY_AUTH_TOKEN_PATH (default ~/.ray/auth_token); `ray get-auth-token` on the head node prints it, "
    "on KubeRay it is the Secret named in authOptions.secretName (key auth_token)"
)


class ClusterConnectionError(ValueError):
    """The Ray cluster cannot be reached as configured (address, token)."""


def ensure_ray(address: str = "", needed_cpus: float = 1.0, *, timeout_s: float = CONNECT_TIMEOUT_S,
               inline_bytes: Optional[int] = None) -> None:
    """Connect this process to Ray once: `address` (or RAY_ADDRESS) or an embedded local Ray
    with at least `needed_cpus` CPUs, passing objects up to `inline_bytes` inline
    (`local_system_config`; default DEFAULT_INLINE_BYTES). Raises ClusterConnectionError within
    about `timeout_s` seconds when an existing cluster cannot be reached or refuses this
    process's token."""
    import ray

    if ray.is_initialized():
        return
    address = (address or os.environ.get("RAY_ADDRESS", "")).strip()
    if address:
        check_cluster(address, timeout_s=timeout_s)
        try:
            ray.init(address=address, log_to_driver=False)
        except (ConnectionError, ray.exceptions.AuthenticationError) as exc:
            raise ClusterConnectionError(f"cannot connect to the Ray cluster at {address}: {exc}") from exc
        return
    # address="local": always a new embedded Ray. Plain ray.init() would instead join the cluster
    # of the last `ray start` on this machine (/tmp/ray/ray_current_cluster) and then reject num_cpus.
    ray.init(address="local", num_cpus=max(int(-(-needed_cpus // 1)), os.cpu_count() or 1),
             include_dashboard=False, log_to_driver=False, configure_logging=False,
             _system_config=local_system_config(DEFAULT_INLINE_BYTES if inline_bytes is None else inline_bytes))


#: Options of every actor widedp creates (shards, trainers, their replacements): not detached,
#: so each is owned by the process that created it — the driver (`widedp train`, the coordinator)
#: — and Ray's fate-sharing ends it when the driver exits or dies, even by SIGKILL: nothing of a
#: run (its shards hold the model and the step's private sums) outlives its driver. Explicit, so
#: that a job-level default (`JobConfig(default_actor_lifetime="detached")`) cannot change it.
#: No actor has a name, so none can be looked up from another job either.
#: Measured (tests/test_run_cleanup.py; Ray 2.60, 2 CPUs loaded by other jobs): after a SIGKILL of a
#: `widedp train` driver (2 shard actors, with or without 2 trainer actors) the actors were gone
#: 2.1-2.9 s later on the embedded cluster (its GCS and raylet die with the driver at once; the
#: workers notice their raylet's death) and 0.1-0.2 s later on a `ray start` cluster (the raylet
#: sees the driver's connection close; the GCS marks the job dead and kills its actors). What
#: lingers on the embedded cluster, ~60 s, is Ray's own DashboardAgent and RuntimeEnvAgent (not
#: actors, no run state): they keep trying to report their raylet's death to the GCS that died
#: with it (RAY_gcs_rpc_server_reconnect_timeout_s=5 did not shorten it).
ACTOR_OPTIONS = {"lifetime": "non_detached"}

#: Ray settings of the embedded local cluster: a step's shard calls carry 0.1-2 MB each (ids out,
#: pooled embeddings back, pooled-output gradients out: 26 x 1024 x 16 float32 = 1.7 MB on the CTR
#: model), above Ray's 100 kB default for passing objects inline, so each went through the
#: object store. Inline up to 8 MB: the Ray CTR step (4 shards, 2 cores) went from 66 to 53 ms,
#: the lookup round from 17 to 11 ms (measured together, docs/DESIGN.md §2.1). A cluster of
#: your own takes the same settings at `ray start --system-config '{...}'`.


def local_system_config(inline_bytes: int) -> dict:
    """The embedded Ray's settings: objects up to `inline_bytes` inline in the call, and room for
    two of them in one task's RPC."""
    return {"max_direct_call_object_size": int(inline_bytes),
            "task_rpc_inlined_bytes_limit": max(2 * int(inline_bytes), 10 * 1024 * 1024)}


LOCAL_SYSTEM_CONFIG = local_system_config(DEFAULT_INLINE_BYTES)


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) -> (host, port); ClusterConnectionError for anything else."""
    text = address.strip()
    if "://" in text:
        scheme = text.split("://", 1)[0].lower()
        if scheme in ("http", "https"):
            raise ClusterConnectionError(
                f"cluster address {address!r} is a dashboard / Jobs API URL; `widedp train --address` (and "
                "cluster.address) take the GCS address HOST:PORT (the head's `ray start --head --port`, default "
                f"6379). To go through the Jobs API run `ray job submit --address {text} -- widedp train ...` "
                "without --address: the job finds its cluster by itself")
        raise ClusterConnectionError(f"cluster address {address!r}: unsupported scheme {scheme!r} (expected HOST:PORT)")
    if text.startswith("[") and "]" in text:  # [IPv6]:PORT
        host, rest = text[1:text.index("]")], text[text.index("]") + 1:]
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterConnectionError(
            f"cluster address {address!r} is not HOST:PORT (the head's GCS port, default 6379)")
    return host, int(port)


def token_source() -> str:
    """Where this process's Ray token comes from, in Ray's order of precedence (never the token)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "the RAY_AUTH_TOKEN environment variable"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"the file {os.environ['RAY_AUTH_TOKEN_PATH']} (RAY_AUTH_TOKEN_PATH)"
    return "~/.ray/auth_token"


def _token_auth_enabled() -> bool:
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token authentication
        return False
    return is_token_auth_enabled()


def _check_token_available(address: str) -> None:
    """With RAY_AUTH_MODE=token, fail now (not after Ray's ~20 s retries) if no token is found."""
    import ray

    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]  # Cython module: no stub lists it

    try:
        found = AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True)
    except ray.exceptions.AuthenticationError as exc:  # e.g. RAY_AUTH_TOKEN_PATH names a missing file
        detail = str(exc).split(". Ensure", 1)[0]
        raise ClusterConnectionError(f"cannot connect to {address}: RAY_AUTH_MODE=token, but: {detail}; {_TOKEN_HELP}")
    if not found:
        raise ClusterConnectionError(
            f"cannot connect to {address}: RAY_AUTH_MODE=token but no token was found (looked in RAY_AUTH_TOKEN, "
            f"RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token); {_TOKEN_HELP}")


def check_cluster(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Optional[bytes]:
    """Pre-connection check of a GCS address (HOST:PORT): returns the cluster id, or raises
    ClusterConnectionError saying what is wrong. `auto` / `local` / `ray://` addresses are left
    to Ray. Uses one unary gRPC call (NodeInfoGcsService.GetClusterId) with a deadline."""
    if address in ("auto", "local") or address.startswith("ray://"):
        return None
    host, port = split_address(address)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ClusterConnectionError(f"cannot connect to {address}: host {host!r} does not resolve ({exc})")
    token_mode = _token_auth_enabled()
    if token_mode:
        _check_token_available(address)

    try:
        import grpc

        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:  # Ray moved its internals: leave the connection errors to ray.init
        return None

    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    channel = init_grpc_channel(target)  # TLS (RAY_USE_TLS) and the token header, as Ray's own clients
    try:
        reply = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
            gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)  # type: ignore[attr-defined]  # generated protobuf
        return reply.cluster_id
    except grpc.RpcError as exc:
        raise ClusterConnectionError(_explain(address, exc.code(), exc.details() or "", token_mode, timeout_s))
    finally:
        channel.close()


def _explain(address: str, code, details: str, token_mode: bool, timeout_s: float) -> str:
    import grpc

    where = f"cannot connect to the Ray cluster at {address}"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        if not token_mode:
            mode = os.environ.get("RAY_AUTH_MODE") or "unset"
            return (f"{where}: the cluster requires a token but token authentication is off in this process "
                    f"(RAY_AUTH_MODE={mode}); {_TOKEN_HELP}")
        return (f"{where}: the cluster rejected this process's token (read from {token_source()}); it is not the "
                f"cluster's token: {_TOKEN_HELP}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return (f"{where}: no answer within {timeout_s:g} s (wrong host, a firewall, or the head is not up yet); "
                "the address is the head's GCS port (`ray start --head --port`, default 6379)")
    if code == grpc.StatusCode.UNAVAILABLE:
        low = details.lower()
        if "http1" in low or "http/1" in low or "http status" in low or "failed parsing http/2" in low:
            return (f"{where}: that port speaks HTTP, not Ray's GCS gRPC; it is probably the dashboard (8265). "
                    "Use the GCS port (default 6379), or `ray job submit --address http://HEAD:8265 ...`")
        if "refused" in low:
            return (f"{where}: nothing is listening there (connection refused); is the head running, and is the "
                    "port the head's GCS port (`ray start --head --port`, default 6379)?")
        return f"{where}: unreachable ({details})"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (f"{where}: a gRPC server answers but it is not a Ray GCS (the Ray Client port 10001 or a raylet?); "
                "use the head's GCS port (default 6379)")
    return f"{where}: {code.name}: {details}"
