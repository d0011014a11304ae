"""``etcd://``: the etcd coordinator: the backend, its keys, the waiters' queue, the gRPC and
gateway transports and etcd's messages."""
