"""``sqlite:``: the embedded coordinator (one host, many processes): the backend, its database
and schema, its files and permissions, the wake-up sockets of waiters, backup and restore."""
