"""Reading compiled kernels' SASS back: loops between a label and the branch back to it."""

from __future__ import annotations

from ember.bench.sass import instructions, loops

# nvdisasm -c's layout: a label on its own line, then addressed instructions; an outer loop
# holding an inner one, and the trap loop after EXIT that branches to itself.
SASS = """
        .text._k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_CTAID.X ;
.L_x_0:
        /*0020*/                   IMAD.SHL.U32 R2, R0, 0x8, RZ ;
.L_x_1:
        /*0030*/                   LOP3.LUT R3, R2, 0x1c00000, RZ, 0xc0, !PT ;
        /*0040*/                   FFMA R4, R3, R5, R4 ;
        /*0050*/                   FFMA R6, R3, R7, R6 ;
        /*0060*/              @!P0 BRA `(.L_x_1) ;
        /*0070*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0080*/               @P1 BRA `(.L_x_0) ;
        /*0090*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*00a0*/                   EXIT ;
.L_x_3:
        /*00b0*/                   BRA `(.L_x_3);
"""


def test_instructions_keep_their_opcodes_modifiers_and_labels():
    found, labels = instructions(SASS)
    assert [i.address for i in found] == list(range(0, 0xC0, 0x10))
    assert found[2].opcode == "IMAD.SHL.U32" and found[2].mnemonic == "IMAD"
    assert found[6].mnemonic == "BRA"  # predicated: the predicate is not the opcode
    assert labels == {".L_x_0": 0x20, ".L_x_1": 0x30, ".L_x_2": 0xA0, ".L_x_3": 0xB0}


def test_loops_are_backward_branches_inner_first():
    inner, outer = loops(SASS)
    assert [i.address for i in inner.body] == [0x30, 0x40, 0x50, 0x60]
    assert inner.mix() == [("FFMA", 2), ("LOP3.LUT", 1), ("BRA", 1)]
    assert outer.body[0].address == 0x20 and outer.body[-1].address == 0x80
    assert len(outer.body) == 7  # the forward branch and the trap's self-branch are no loops
