"""Row tables: row-sparse values and the tables the owners keep."""
