// RUN: hspmd-opt %s -p insert-reshard | filecheck %s

// A consumer that needs another layout than its operand has gets a dist.reshard in front:
// the elementwise ops need the replicated w split like x (one reshard, shared by both
// consumers); the output needs its value replicated; the assign needs the parameter's
// layout. Operands that already fit are left alone.

#dup = #dist.layout<"[0,1]: dup=2">
#split = #dist.layout<"[0,1]: split(0)=2">
builtin.module {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "zeros"} : tensor<8x4xf32, #dup>
    %x = graph.input "x" : tensor<8x4xf32, #split>
    %s = graph.add %x, %w : (tensor<8x4xf32, #split>, tensor<8x4xf32, #dup>) -> tensor<8x4xf32, #split>
    %t = graph.mul %s, %w : (tensor<8x4xf32, #split>, tensor<8x4xf32, #dup>) -> tensor<8x4xf32, #split>
    graph.output "t", %t : tensor<8x4xf32, #split>
    graph.assign "w", %s : tensor<8x4xf32, #split>
    func.return
  }
}

// CHECK-LABEL: func.func @train_step
// CHECK:         %x = graph.input "x"
// CHECK-NEXT:    [[WS:%.*]] = dist.reshard %w : tensor<8x4xf32, #dist.layout<"[0,1]: dup=2">> -> tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK-NEXT:    %s = graph.add %x, [[WS]] : (tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2">>, tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2">>) -> tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK-NEXT:    %t = graph.mul %s, [[WS]] : (tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2">>, tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2">>) -> tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2">>
// CHECK-NEXT:    [[TD:%.*]] = dist.reshard %t : tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2">> -> tensor<8x4xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    graph.output "t", [[TD]] : tensor<8x4xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    [[SD:%.*]] = dist.reshard %s : tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2">> -> tensor<8x4xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    graph.assign "w", [[SD]] : tensor<8x4xf32, #dist.layout<"[0,1]: dup=2">>
// CHECK-NEXT:    func.return
