"""A chief whose task watchdog asks without pause while the interpreter ends: it must exit.

Tasks 1-3 answer (a plain gRPC server standing in for `tf.distribute.Server`), so a request is
in flight whenever the main thread returns after `argv[1]` seconds."""
import sys
import time
from concurrent import futures

import grpc

from dapple.runtime.tf_cluster import watchdog


class StatusAnswers(grpc.GenericRpcHandler):
    def service(self, details):
        if details.method == watchdog.GET_STATUS:
            return grpc.unary_unary_rpc_method_handler(lambda request, context: b"")
        return None


server = grpc.server(futures.ThreadPoolExecutor(2))
server.add_generic_rpc_handlers((StatusAnswers(),))
port = server.add_insecure_port("localhost:0")
server.start()
watchdog.PERIOD_SECONDS = 0.0
watchdog.watch_tasks(["localhost:1"] + [f"localhost:{port}"] * 3)
time.sleep(float(sys.argv[1]))
print("main thread done", flush=True)
