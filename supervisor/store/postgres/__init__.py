"""The PostgreSQL StateStore (run by sessiond): the link (one connection and
its retries), the schema, the rows, the batched writes and the store.

May import what supervisor.store may import, and the rest of supervisor.store.
"""
