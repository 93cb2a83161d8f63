// RUN: hspmd-opt %s -p 'apply-strategy{strategy="[0,1]: dp=2 share=3 | [2]: dp=1 share=1"}' | filecheck %s

// Several device groups, data parallel only (HetSeq-style): parameters are replicated in every
// group (hetero=dup), batch inputs split along dim 0 across the groups by their shares (16
// rows: 12 to [0,1], 6 per rank, and 4 to [2]) and over each group's dp; a scalar input is
// replicated like a parameter.

builtin.module {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "zeros"} : tensor<4x3xf32>
    %x = graph.input "x" : tensor<16x4xf32>
    %s = graph.input "s" : tensor<f32>
    %y = graph.matmul %x, %w : (tensor<16x4xf32>, tensor<4x3xf32>) -> tensor<16x3xf32>
    graph.output "y", %y : tensor<16x3xf32>
    func.return
  }
}

// CHECK:      %w = graph.parameter "w" {init = "zeros"} : tensor<4x3xf32, #dist.layout<"[0,1]: dup=2 | [2]: dup=1 ; hetero=dup">>
// CHECK-NEXT: %x = graph.input "x" : tensor<16x4xf32, #dist.layout<"[0,1]: split(0)=2 | [2]: dup=1 ; hetero=split(0), shares=3:1">>
// CHECK-NEXT: %s = graph.input "s" : tensor<f32, #dist.layout<"[0,1]: dup=2 | [2]: dup=1 ; hetero=dup">>
// CHECK-NEXT: %y = graph.matmul {{.*}} -> tensor<16x3xf32>{{$}}
