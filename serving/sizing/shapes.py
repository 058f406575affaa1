"""A shape: how many engines of which size run in which role on a box of `total_units` units.

  Shape              engines per role (`colocated`: role-flexible `both` engines; `prefill`, `decode`),
                     each engine's size in units; `label` ("2x1 both", "1P(1)+1D(2)")
  enumerate_shapes   every shape a box allows from a set of engine sizes, sorted

raypd's deployment has one engine group per role, all its engines alike (serving/config.py), so a
shape's engines of one role share one size.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    colocated: tuple[int, ...] = ()  # units of each `both` engine (prefill and decode on one engine)
    prefill: tuple[int, ...] = ()  # units of each prefill engine
    decode: tuple[int, ...] = ()  # units of each decode engine

    def __post_init__(self) -> None:
        for role, sizes in (("both", self.colocated), ("prefill", self.prefill), ("decode", self.decode)):
            if len(set(sizes)) > 1:
                raise ValueError(f"{role} engines must all be one size (got {sizes})")
            if any(k < 1 for k in sizes):
                raise ValueError(f"{role} engines need at least one unit each (got {sizes})")
        if not (self.colocated or self.decode):
            raise ValueError("a shape needs a decode-capable engine (both or decode)")
        if self.prefill and not (self.decode or self.colocated):
            raise ValueError("prefill engines need decode-capable engines to hand their requests to")

    @property
    def is_colocated(self) -> bool:
        return not (self.prefill or self.decode)

    @property
    def engines(self) -> int:
        return len(self.colocated) + len(self.prefill) + len(self.decode)

    @property
    def units(self) -> int:
        return sum(self.colocated) + sum(self.prefill) + sum(self.decode)

    @property
    def label(self) -> str:
        parts = []
        if self.colocated:
            parts.append(f"{len(self.colocated)}x{self.colocated[0]} both")
        if self.prefill:
            parts.append(f"{len(self.prefill)}P({self.prefill[0]})")
        if self.decode:
            parts.append(f"{len(self.decode)}D({self.decode[0]})")
        return "+".join(parts)


def enumerate_shapes(total_units: int, sizes: tuple[int, ...]) -> tuple[Shape, ...]:
    """Every shape within `total_units` whose engines have sizes from `sizes`: n colocated engines of
    k units (n * k <= total), or p prefill engines of kp units and d decode engines of kd units
    (p * kp + d * kd <= total; p, d >= 1). Sorted: colocated first, then by units used (most
    first), then by engine count (fewest first), then by label."""
    sizes = tuple(sorted(set(sizes)))
    shapes = [Shape(colocated=(k,) * n) for k in sizes for n in range(1, total_units // k + 1)]
    for kp in sizes:
        for kd in sizes:
            for p in range(1, (total_units - kd) // kp + 1):
                for d in range(1, (total_units - p * kp) // kd + 1):
                    shapes.append(Shape(prefill=(kp,) * p, decode=(kd,) * d))
    return tuple(sorted(shapes, key=lambda s: (not s.is_colocated, -s.units, s.engines, s.label)))
