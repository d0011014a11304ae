"""The ZooKeeper coordinator (``zk://``): leases ending by the leader's clock, waiters in line."""
