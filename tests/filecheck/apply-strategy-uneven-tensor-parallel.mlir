// RUN: hspmd-opt %s -p 'apply-strategy{strategy="[0,1]: tp=2"}' | filecheck %s --check-prefix=TP2
// RUN: hspmd-opt %s -p 'apply-strategy{strategy="[0-3]: dp=2 tp=2"}' | filecheck %s --check-prefix=MIXED

// tp over dims it does not divide (docs/layouts.md, "Uneven pieces"): wq's output [8, 12] is
// reshaped into 3 heads of 4, which tp=2 cannot halve, so the group is laid out over its tp
// sub-groups (the devices at each tp coordinate: [0], [1]; with dp=2, [0,2] and [1,3]). wq is
// split across them by heads per rank (2:1), as is wo, the row weight its heads feed; w1 (a width
// of 3) and w2 by equal shares (2 and 1 by largest remainder); the batch and replicated weights
// are hetero=dup. The row output (wo's product, dim 0 the batch) is laid out like the batch.

builtin.module {
  func.func @train_step() {
    %wq = graph.parameter "wq" {init = "zeros"} : tensor<4x12xf32>
    %wo = graph.parameter "wo" {init = "zeros"} : tensor<12x4xf32>
    %w1 = graph.parameter "w1" {init = "zeros"} : tensor<4x3xf32>
    %w2 = graph.parameter "w2" {init = "zeros"} : tensor<3x4xf32>
    %x = graph.input "x" : tensor<8x4xf32>
    %q = graph.matmul %x, %wq : (tensor<8x4xf32>, tensor<4x12xf32>) -> tensor<8x12xf32>
    %h = graph.reshape %q : (tensor<8x12xf32>) -> tensor<8x3x4xf32>
    %t = graph.tanh %h : (tensor<8x3x4xf32>) -> tensor<8x3x4xf32>
    %f = graph.reshape %t : (tensor<8x3x4xf32>) -> tensor<8x12xf32>
    %o = graph.matmul %f, %wo : (tensor<8x12xf32>, tensor<12x4xf32>) -> tensor<8x4xf32>
    %a = graph.matmul %o, %w1 : (tensor<8x4xf32>, tensor<4x3xf32>) -> tensor<8x3xf32>
    %r = graph.relu %a : (tensor<8x3xf32>) -> tensor<8x3xf32>
    %y = graph.matmul %r, %w2 : (tensor<8x3xf32>, tensor<3x4xf32>) -> tensor<8x4xf32>
    graph.output "y", %y : tensor<8x4xf32>
    func.return
  }
}

// TP2:      %wq = graph.parameter "wq" {init = "zeros"} : tensor<4x12xf32, #dist.layout<"[0]: dup=1 | [1]: dup=1 ; hetero=split(1), shares=2:1">>
// TP2-NEXT: %wo = graph.parameter "wo" {init = "zeros"} : tensor<12x4xf32, #dist.layout<"[0]: dup=1 | [1]: dup=1 ; hetero=split(0), shares=2:1">>
// TP2-NEXT: %w1 = graph.parameter "w1" {init = "zeros"} : tensor<4x3xf32, #dist.layout<"[0]: dup=1 | [1]: dup=1 ; hetero=split(1), shares=1:1">>
// TP2-NEXT: %w2 = graph.parameter "w2" {init = "zeros"} : tensor<3x4xf32, #dist.layout<"[0]: dup=1 | [1]: dup=1 ; hetero=split(0), shares=1:1">>
// TP2-NEXT: %x = graph.input "x" : tensor<8x4xf32, #dist.layout<"[0]: dup=1 | [1]: dup=1 ; hetero=dup">>
// TP2:      %o = graph.matmul {{.*}} -> tensor<8x4xf32, #dist.layout<"[0]: dup=1 | [1]: dup=1 ; hetero=dup">>

// MIXED:      %wq = graph.parameter "wq" {init = "zeros"} : tensor<4x12xf32, #dist.layout<"[0,2]: dup=2 | [1,3]: dup=2 ; hetero=split(1), shares=2:1">>
// MIXED-NEXT: %wo = graph.parameter "wo" {init = "zeros"} : tensor<12x4xf32, #dist.layout<"[0,2]: dup=2 | [1,3]: dup=2 ; hetero=split(0), shares=2:1">>
// MIXED-NEXT: %w1 = graph.parameter "w1" {init = "zeros"} : tensor<4x3xf32, #dist.layout<"[0,2]: dup=2 | [1,3]: dup=2 ; hetero=split(1), shares=1:1">>
// MIXED-NEXT: %w2 = graph.parameter "w2" {init = "zeros"} : tensor<3x4xf32, #dist.layout<"[0,2]: dup=2 | [1,3]: dup=2 ; hetero=split(0), shares=1:1">>
// MIXED-NEXT: %x = graph.input "x" : tensor<8x4xf32, #dist.layout<"[0,2]: split(0)=2 | [1,3]: split(0)=2 ; hetero=dup">>
// MIXED:      %o = graph.matmul {{.*}} -> tensor<8x4xf32, #dist.layout<"[0,2]: split(0)=2 | [1,3]: split(0)=2 ; hetero=dup">>
