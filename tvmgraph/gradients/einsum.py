"""Gradient of ``einsum`` (``torch.einsum``, and ``diagonal``/``trace``, which TVM's frontend
lowers to einsum)."""

from __future__ import annotations

import string

from tvm import relax

from ._common import dtype_of, register, shape_of

op = relax.op


def _explicit_terms(subscripts: str, ndims: list[int]) -> tuple[list[str], str]:
    """The operand terms and the output term of ``subscripts`` with every ``...`` spelled out in
    unused letters, and the implicit output (no ``->``) made explicit as numpy defines it."""
    spec = subscripts.replace(" ", "")
    inputs, arrow, output = spec.partition("->")
    terms = inputs.split(",")
    fresh = [c for c in string.ascii_letters if c not in spec]
    batch = max((n - (len(t) - 3) for t, n in zip(terms, ndims) if "..." in t), default=0)
    terms = [t.replace("...", "".join(fresh[batch - (n - (len(t) - 3)) : batch]))
             for t, n in zip(terms, ndims)]
    if arrow:
        output = output.replace("...", "".join(fresh[:batch]))
    else:
        letters = "".join(terms)
        output = "".join(fresh[:batch]) + "".join(
            sorted(c for c in set(letters) if letters.count(c) == 1 and c not in fresh[:batch]))
    return terms, output


@register("relax.einsum")
def einsum_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = einsum(t_0, ..., t_{n-1} -> o)``: ``dx_k = einsum(dy, x_j (j != k) -> t_k)``.

    A letter repeated in ``t_k`` (a diagonal, ``ii->i``) is renamed in the result and tied to
    the first by an identity matrix operand (``dx[i, i'] = ... eye[i, i']``); a letter of
    ``t_k`` that no other operand carries (summed away by the forward) comes from a ones vector,
    which broadcasts it.
    """
    operands = orig_call.args[0]
    count = len(operands.ty.fields)
    xs = [relax.TupleGetItem(operands, i) if not isinstance(operands, relax.Tuple)
          else operands.fields[i] for i in range(count)]
    shapes = [shape_of(x) for x in xs]
    terms, output = _explicit_terms(str(orig_call.attrs.subscripts), [len(s) for s in shapes])
    sizes: dict[str, int] = {}
    for term, shape in zip(terms, shapes):
        for letter, size in zip(term, shape):
            if sizes.setdefault(letter, size) != size:
                raise NotImplementedError(
                    f"gradient of relax.einsum {orig_call.attrs.subscripts!r} with broadcast dimensions")
    dtype = dtype_of(orig_var)
    unused = iter(c for c in string.ascii_letters if c not in sizes)
    grad, grad_term = output_grad, output
    if not output:  # a 0-d operand term is not accepted: dy as a size-1 vector summed away
        grad, grad_term = op.reshape(output_grad, [1]), next(unused)
    grads = []
    for k, term in enumerate(terms):
        in_terms = [grad_term, *(t for j, t in enumerate(terms) if j != k)]
        in_exprs = [grad, *(x for j, x in enumerate(xs) if j != k)]
        result = ""
        for letter in term:
            if letter in result:
                renamed = next(unused)
                in_terms.append(letter + renamed)
                in_exprs.append(op.eye(sizes[letter], dtype=dtype))
                letter = renamed
            result += letter
        for letter in dict.fromkeys(term):
            if not any(letter in t for t in in_terms):
                in_terms.append(letter)
                in_exprs.append(op.ones([sizes[letter]], dtype))
        spec = ",".join(in_terms) + "->" + result
        grads.append(op.einsum(in_exprs, spec))
    return [relax.Tuple(grads)]
