"""radixserve on Ray Serve (`pip install 'radixserve[ray]'`): replicas that are whole radixserve
servers, an HTTP ingress, and a prefix-aware request router (Ray Serve's request-router API)
that runs the same policy as the data-parallel engine (radixserve.routing).

    client --HTTP--> Ray proxy --> RadixServeIngress --handle (PrefixAwareRequestRouter)--> RadixServeReplica
                                   reads the body for the                             a `radixserve serve` on
                                   routing key, retries a                             127.0.0.1, proxied unchanged
                                   request no byte of which went out

Start it with `radixserve serve --ray --replicas N` (radixserve.ray.serve.run_ray) or with
`serve run` and the builder radixserve.ray.serve:app_builder (examples/ray/serve_config.yaml).

Nothing here is imported by `import radixserve`: each module imports ray itself.
"""
