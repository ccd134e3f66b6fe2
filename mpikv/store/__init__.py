"""The store's face and the life of a call: KVStore, create, the protocol, join, a store over the survivors."""
