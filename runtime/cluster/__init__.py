"""kvrun past one machine, on Ray Serve (`kvrun serve --ray`; docs/cluster.md): N replicas,
each the single-machine engine + scheduler + HTTP app (runtime/cli/server.py), behind one
ingress that forwards each HTTP request to a replica's app unchanged (forward.py, ingress.py),
a request router that sends a prompt where its prefix was computed (router.py, affinity.py),
and a shared tier of compressed prefix snapshots any replica restores (store.py,
shared_tier.py). Needs the optional extra `kvrun[cluster]` (Ray Serve); nothing outside this
package imports Ray, and this package is imported only for `--ray`."""
