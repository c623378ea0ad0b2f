"""The catalogue of training images as the scheduler keeps it, and what it says of a job's image (SPEC J10).

Pure rules: the catalogue folded from its events, the problems of a spec's `image` (unknown, not marked for
training, not built for the board of one of the job's flavors), and the image a job is accepted with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from libs.contracts.cluster import Flavor
from libs.contracts.events import ImageDeleted, ImageMarked, ImageRegistered
from libs.contracts.images import ImageRecord, ImageRefError, ImageUse, flavor_board, image_ref, parse_image_ref, use_of
from libs.contracts.jobspec import FieldError, JobSpec

LIST_HINT = "`trainyard image list` shows the images jobs may run in"


def fold_image(images: dict[str, ImageRecord], event: ImageRegistered | ImageMarked | ImageDeleted
               ) -> dict[str, ImageRecord]:
    """The catalogue after `event` (changed in place, and returned)."""
    if isinstance(event, ImageRegistered):
        images[event.image.ref] = event.image
    elif isinstance(event, ImageMarked):
        if (known := images.get(event.ref)) is not None:
            images[event.ref] = msgspec.structs.replace(known, training=event.training)
    else:
        images.pop(event.ref, None)
    return images


def canonical_ref(ref: str) -> str:
    """NAME:TAG for NAME[:TAG]; raises ImageRefError."""
    return image_ref(*parse_image_ref(ref))


def image_errors(spec: JobSpec, images: Mapping[str, ImageRecord], flavors: Sequence[Flavor]) -> list[FieldError]:
    """J10: what is wrong with the spec's image here (none without one). `flavors`: the cluster's."""
    if spec.image is None:
        return []
    try:
        ref = canonical_ref(spec.image)
    except ImageRefError as exc:
        return [FieldError(field="image", message=str(exc), hint="write NAME:TAG, e.g. pytorch/cpu:2.13")]
    image = images.get(ref)
    if image is None:
        return [FieldError(field="image", message=f"{ref} is not a registered image", hint=LIST_HINT)]
    errors = []
    if not image.training:
        errors.append(FieldError(field="image", message=f"{ref} is not marked for training jobs",
                                 hint=f"an administrator can mark it: trainyard image mark {ref}"))
    known = {flavor.name: flavor for flavor in flavors}
    for i, name in enumerate(spec.flavors):
        flavor = known.get(name)
        if flavor is not None and flavor_board(flavor.board) not in image.boards:
            errors.append(FieldError(
                field=f"flavors[{i}]",
                message=f"flavor {name!r} has board {flavor_board(flavor.board)}, and image {ref} is built for "
                f"{', '.join(image.boards)}",
                hint="choose a flavor of a board the image is built for, or an image built for this board"))
    return errors


def image_use(spec: JobSpec, images: Mapping[str, ImageRecord]) -> ImageUse | None:
    """The image a job with `spec` is accepted with (None without one). Raises LookupError when the spec's
    image is no longer in the catalogue, or not marked for training any more."""
    if spec.image is None:
        return None
    ref = canonical_ref(spec.image)
    image = images.get(ref)
    if image is None or not image.training:
        raise LookupError(f"image {ref} was deleted or unmarked meanwhile")
    return use_of(image)
