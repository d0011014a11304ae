"""``sqlite:``: the embedded coordinator (one host, many processes): the backend, its SQL
statements, its queue and the wake-up sockets of waiters, its database and schema, its files and
permissions, backup and restore."""
