"""Reading files from others, with their limits; writing the run's own files atomically within its disk budget.

Every reader here checks what a file declares (tensor shapes, zip entry sizes, image headers) against
the active limits (:mod:`surgery.core.limits`) before decompressing or allocating, and every path a
data file names stays inside the directory it came from under ``safe=true`` (:mod:`surgery.files.paths`).
"""
