"""The Ray Serve config file for a Cleave deployment (`cleave build-serve-config`, the Helm
chart's `serveConfigV2`): the proxies' HTTP and gRPC options and one application whose `args`
are the Cleave config, built by `cluster.app:build_app`."""

from __future__ import annotations

from typing import Any

import yaml

from cluster.config import CleaveConfig, is_loopback

GRPC_SERVICER = "router.proto.cleave.v1.generate_pb2_grpc.add_GenerationServicer_to_server"
IMPORT_PATH = "cluster.app:build_app"


def build_serve_config(config: CleaveConfig, app_name: str = "cleave") -> dict[str, Any]:
    """What `serve deploy` reads. The proxies bind `router.host`; with `router.ingress` direct
    there are none (the router replicas bind the ports themselves). Serve's gRPC proxy binds
    every interface whatever the host, so with a loopback host it is left off (gRPC there
    needs `ingress: direct`)."""
    r = config.router
    grpc_open = r.ingress == "direct" or not is_loopback(r.host)
    return {
        "proxy_location": "EveryNode" if r.ingress == "serve" else "Disabled",
        "http_options": {"host": r.host, "port": r.http_port},
        "grpc_options": {"port": r.grpc_port,
                         "grpc_servicer_functions": [GRPC_SERVICER] if grpc_open else []},
        "applications": [{"name": app_name, "route_prefix": "/", "import_path": IMPORT_PATH,
                          "args": config.to_dict()}],
    }


def serve_config_yaml(config: CleaveConfig, app_name: str = "cleave") -> str:
    return yaml.safe_dump(build_serve_config(config, app_name), sort_keys=False)
