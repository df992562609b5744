# Exit 0 only when the router at $TANDEM_ROUTER answers grpc.health.v1 Check("") with SERVING.
# With $TANDEM_TLS_CA set the channel is TLS (and presents $TANDEM_TLS_CERT/$TANDEM_TLS_KEY when set, checking
# the router's certificate for $TANDEM_TLS_SERVER_NAME when set): the chart's TLS probes and helm test.
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def read(name):
    path = os.environ.get(name)
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


target = os.environ["TANDEM_ROUTER"]
timeout = float(os.environ.get("TANDEM_HEALTH_TIMEOUT", "10"))
if os.environ.get("TANDEM_TLS_CA"):
    credentials = grpc.ssl_channel_credentials(
        read("TANDEM_TLS_CA"), read("TANDEM_TLS_KEY"), read("TANDEM_TLS_CERT")
    )
    name = os.environ.get("TANDEM_TLS_SERVER_NAME")
    options = [("grpc.ssl_target_name_override", name)] if name else []
    channel = grpc.secure_channel(target, credentials, options=options)
else:
    channel = grpc.insecure_channel(target)
with channel:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout
        )
    except grpc.RpcError as exc:
        sys.exit(f"{target}: health check failed: {exc.code().name} {exc.details()}")
status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
print(f"{target}: {status}")
sys.exit(0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1)
