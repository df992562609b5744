"""What both worker roles share: an engine on its loop thread behind a gRPC server, and a Ray actor shell.

prefill_worker and decode_worker never import each other; they both stand on this package.
"""
