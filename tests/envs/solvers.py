"""Plain-Python reference solvers (breadth-first search), independent of the JAX code.

They work on text boards (the documented symbols) or on plain sets of cells, so the tests
check the environments against the rules as written, not against their own helpers.
"""

from collections import deque

# (row, col) steps by name; the environments' action ids are mapped in the tests.
STEPS = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}


def frozen_lake_path(board: str) -> list[str] | None:
    """Shortest list of moves from P to G on a FrozenLake text board avoiding holes, or None."""
    rows = board.split("\n")
    cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
    start = next(rc for rc, ch in cells.items() if ch == "P")
    parents = {start: None}
    queue = deque([start])
    while queue:
        here = queue.popleft()
        if cells[here] == "G":
            path = []
            while parents[here] is not None:
                here, move = parents[here]
                path.append(move)
            return path[::-1]
        for move, (dr, dc) in STEPS.items():
            there = (here[0] + dr, here[1] + dc)
            if cells.get(there, "O") != "O" and there not in parents:
                parents[there] = (here, move)
                queue.append(there)
    return None


def parse_sokoban(board: str):
    """(walls, targets, boxes, player) from a Sokoban text board; cells are (row, col)."""
    walls, targets, boxes, player = set(), set(), set(), None
    for r, row in enumerate(board.split("\n")):
        for c, ch in enumerate(row):
            if ch == "#":
                walls.add((r, c))
            if ch in "O√S":
                targets.add((r, c))
            if ch in "X√":
                boxes.add((r, c))
            if ch in "PS":
                player = (r, c)
    return walls, targets, boxes, player


def sokoban_move(walls, boxes, player, move: str):
    """(boxes, player) after `move` by the rules as written: walk onto floor, push a box
    whose far side is floor; the same pair when a wall or a blocked box is in the way."""
    dr, dc = STEPS[move]
    one = (player[0] + dr, player[1] + dc)
    two = (one[0] + dr, one[1] + dc)
    if one in walls:
        return boxes, player
    if one in boxes:
        if two in walls or two in boxes:
            return boxes, player
        boxes = (boxes - {one}) | {two}
    return boxes, one


def sokoban_path(walls, targets, boxes, player, max_states: int = 200_000) -> list[str] | None:
    """Shortest move list that puts every box on a target, or None if there is none.

    Raises RuntimeError when more than `max_states` states would be explored, so a test can
    never pass by giving up.
    """
    targets = frozenset(targets)
    start = (player, frozenset(boxes))
    parents = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        here, on = state
        if on == targets:
            path = []
            while parents[state] is not None:
                state, move = parents[state]
                path.append(move)
            return path[::-1]
        for move in STEPS:
            boxes_after, player_after = sokoban_move(walls, on, here, move)
            after = (player_after, boxes_after)
            if after not in parents:
                if len(parents) >= max_states:
                    raise RuntimeError(f"more than {max_states} states")
                parents[after] = (state, move)
                queue.append(after)
    return None
