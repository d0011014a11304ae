"""The ZooKeeper coordinator (``zk://``): leases on ephemeral znodes, sequential waiters."""
