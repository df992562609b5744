"""The `tandem` command line: generate (against a server or offline), status, serve, bench.

Separate from the SDK (`tandem_client`, which needs only tandem_api, grpc and protobuf) because the command may
import anything: `--offline` runs model_runtime in-process and `serve` starts deploy. Those imports stay inside
the functions that need them, so `tandem status` or `tandem generate --server` start without torch.
"""
