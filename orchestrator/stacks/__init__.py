"""Stacks layer: where each task of a hung job was (issue 26) — captured before a stop and on
demand, kept in the run record, said in one line per task, shown on the page."""
