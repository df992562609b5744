# Exit 0 only when the router at $TANDEM_ROUTER answers grpc.health.v1 Check("") with SERVING.
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

target = os.environ["TANDEM_ROUTER"]
with grpc.insecure_channel(target) as channel:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
    except grpc.RpcError as exc:
        sys.exit(f"{target}: health check failed: {exc.code().name} {exc.details()}")
status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
print(f"{target}: {status}")
sys.exit(0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1)
