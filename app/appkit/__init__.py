"""Glue between the pages and attnlab: model sources, cached analyses, export menus, training runs.

Pages import from here and stay thin; nothing in this package computes attention statistics or
builds figures (that is ``attnlab`` and ``attnlab.figures``).
"""
